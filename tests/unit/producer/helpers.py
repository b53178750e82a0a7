"""A manifest builder and a hold in the pull ledger shared by the producer's unit tests."""

from __future__ import annotations

from kv_connector.producer.pull.ledger import PullLedger
from kv_connector.wire import protocol
from kv_connector.wire.layout import BlockLayout

LAYOUT = BlockLayout("LTH", 16, 2, 8, "float32")


def manifest(rid: str, n: int = 40) -> protocol.Manifest:
    return protocol.Manifest(
        request_id=rid,
        token_ids=list(range(n)),
        layer_ids=[1, 2],
        geometry=LAYOUT,
        num_blocks=LAYOUT.blocks_for(n),
    )


def held(led: PullLedger, rid: str, nonce: str = "a" * 32, t: float = 0.0) -> None:
    """Held and its request finished at ``t`` (its clock runs)."""
    m = manifest(rid)
    led.hold(rid, nonce, m, list(range(10, 10 + m.num_blocks)), range(m.num_blocks), t)
    led.finished([rid], t)
