"""``python -m scripts.bench.audit``: the logprob audit's CPU per audited row and its share
of the consumer's CPU, on a small shape: both measured, the share a fraction."""

from __future__ import annotations

from scripts.bench import audit


def test_the_audit_and_the_consumer_are_measured_on_the_same_row() -> None:
    out = audit.measure(hidden=256, vocab=1000, tokens_n=256)
    assert out["shape"] == {"hidden": 256, "vocab": 1000, "layers": 4, "tokens": 256, "positions": 4}
    assert out["audit_ms_per_sample"] > 0 and out["consumer_ms_per_sample"] > 0
    assert 0 < out["audit_share_of_consumer_cpu"] < 1
