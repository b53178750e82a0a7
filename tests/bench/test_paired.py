"""``scripts.bench.paired``: the benchmark's pairs alternate their order, the warm-up is not
counted, and a figure is the median of the pair ratios with its min and max."""

from __future__ import annotations

import pytest

from scripts.bench.paired import Run, Spread, memory_mib, run_pairs


def test_pairs_alternate_and_the_warmup_is_not_counted() -> None:
    order: list[str] = []
    rates = {"a": iter([99.0, 10.0, 12.0, 11.0, 30.0]), "b": iter([1.0, 5.0, 4.0, 5.5, 6.0])}

    def arm(name: str) -> Run:
        order.append(name)
        return Run(seconds=1.0, units=next(rates[name]))

    pairs = run_pairs(lambda: arm("a"), lambda: arm("b"), pairs=4, warmup=1)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    ratio = pairs.ratio()
    assert ratio.values == (10 / 5, 12 / 4, 11 / 5.5, 30 / 6)  # paired as they ran, warm-up dropped
    assert ratio.median == pytest.approx((2.0 + 3.0) / 2)
    assert (ratio.low, ratio.high) == (2.0, 5.0)
    assert pairs.each("b").values == (5.0, 4.0, 5.5, 6.0)


def test_a_run_gives_its_rates_and_cpu_per_gigabyte() -> None:
    run = Run(seconds=2.0, units=4096.0, nbytes=4e9, cpu_s=3.0)
    assert run.rate == 2048.0
    assert run.gb_per_s == 2.0
    assert run.cpu_s_per_gb == 0.75
    with pytest.raises(ValueError, match="moves no bytes"):
        _ = Run(seconds=1.0, units=1.0).cpu_s_per_gb
    with pytest.raises(ValueError, match="must take time"):
        Run(seconds=0.0, units=1.0)


def test_a_spread_is_median_min_max() -> None:
    assert Spread.of([3.0, 1.0, 2.0]).rounded() == (2.0, [1.0, 3.0])
    with pytest.raises(ValueError):
        Spread.of([])
    with pytest.raises(ValueError):
        run_pairs(lambda: Run(1.0, 1.0), lambda: Run(1.0, 1.0), pairs=0)


def test_memory_is_read_by_kind() -> None:
    mem = memory_mib()
    assert set(mem) == {"peak", "anon", "file", "shmem"}
    assert mem["peak"] >= mem["anon"] > 0
