"""``python -m scripts.bench.integrity``: each record's CPU cost per GB at each end, on a
small sample, both layouts: every figure measured and positive, and the fingerprint reads
the small part of the bytes it claims."""

from __future__ import annotations

import pytest

from scripts.bench import integrity


@pytest.mark.parametrize("layout", ["TLH", "LTH"])
def test_every_record_is_measured_at_both_ends(layout: str) -> None:
    out = integrity.measure(tokens=64, layout=layout)
    assert set(out["producer_cpu_s_per_GB"]) == {"fingerprint", "xxh3", "blocks"}
    reader = {
        "fingerprint",
        "xxh3",
        "blocks",
        "values_screen",
        "values_screen_sampled",
        "fingerprint_and_screen",
    }
    assert set(out["reader_cpu_s_per_GB"]) == reader
    assert all(v >= 0 for end in ("producer_cpu_s_per_GB", "reader_cpu_s_per_GB") for v in out[end].values())
    assert out["fingerprint_bytes_read_fraction"] == pytest.approx(4 * 8 / (4 * 4096 * 2), rel=1e-3)
