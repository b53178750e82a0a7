"""A manifest builder and a hold in the pull ledger shared by the producer's unit tests."""

from __future__ import annotations

from kv_connector.producer.pull.ledger import PullLedger
from tests.unit.sender.helpers import LAYOUT, manifest

__all__ = ["LAYOUT", "held", "manifest"]


def held(led: PullLedger, rid: str, nonce: str = "a" * 32, t: float = 0.0) -> None:
    """Held and its request finished at ``t`` (its clock runs)."""
    m = manifest(rid)
    led.hold(rid, nonce, m, list(range(10, 10 + m.num_blocks)), range(m.num_blocks), t)
    led.finished([rid], t)
