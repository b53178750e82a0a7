"""The protocol arm (``scripts.bench.protocol``) at a tiny size: every arm moves whole
1 MiB samples, and the figures come from its pairs."""

from __future__ import annotations

import pytest

from scripts.bench import protocol


def test_push_at_small_samples_gives_its_ratio_ceiling_and_cost_per_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(protocol.SAMPLES, "1MiB", 16)
    out = protocol.push("1MiB", pairs=1)
    assert out["samples_per_round"] == 16
    assert min(out["d"], out["engine_acked_raw_over_raw"], out["acked_raw_over_raw"]) > 0
    # e is paired against ea as well: its time per sample and the CPU beyond ea's, each end
    assert set(out["us_per_sample"]) == {"e", "ea", "r"} and min(out["us_per_sample"].values()) > 0
    assert set(out["protocol_us_per_sample"]) == {"producer", "reader"}
    # each end's CPU per sample for e and ea, and the d that e's CPU alone would allow
    cpu = out["cpu_us_per_sample"]
    assert min(cpu["e"]["producer"], cpu["e"]["reader"], cpu["ea"]["producer"]) > 0
    assert cpu["cores"] >= 1 and out["d_cpu_bound"] > 0
