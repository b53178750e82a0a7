"""The data path's figures from its pairs (``scripts.bench.datapath.run._figures``): d and
its parts, e's copy time per GB over r's and the part of each round spent copying, read
from what each arm's round reports (pure: made-up rounds)."""

from __future__ import annotations

import pytest

from scripts.bench.datapath.run import _figures
from scripts.bench.paired import Pairs, Run

GB = 1e9


def _round(seconds: float, post_s: float, cpu_s: float = 0.2) -> Run:
    detail = {"producer_cpu_s": cpu_s / 2, "reader_cpu_s": cpu_s / 2, "post_s": post_s}
    return Run(seconds, 1000.0, GB, cpu_s, detail)


def test_d_and_its_parts_come_from_the_same_pairs() -> None:
    # e's rounds: 0.5 s, 0.4 of it copying; r's: 0.4 s, 0.38 copying
    e_vs_r = Pairs([_round(0.5, 0.4)] * 3, [_round(0.4, 0.38)] * 3)
    other = Pairs([_round(0.5, 0.4)] * 3, [_round(0.5, 0.4)] * 3)
    measured = {name: other for name in ("e0", "em", "b", "ex", "rc", "ra", "ea")}
    out = _figures({"r": e_vs_r, **measured})
    assert out["d"].median == pytest.approx(0.8)
    assert out["copy_s_per_GB_over_raw"].median == pytest.approx(0.4 / 0.38)
    assert out["writer_busy"].median == pytest.approx(0.8)
    assert out["raw_writer_busy"].median == pytest.approx(0.95)
    # d is (about) what the copy's speed and the copying part of the round make it
    parts = out["writer_busy"].median / out["raw_writer_busy"].median / out["copy_s_per_GB_over_raw"].median
    assert parts == pytest.approx(out["d"].median)
