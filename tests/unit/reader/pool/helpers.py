"""A pool's size and base, a manifest builder and a held-back event shared by the pool tests."""

from __future__ import annotations

from kv_connector.wire import protocol
from kv_connector.wire.layout import BlockLayout

POOL = 1 << 20
BASE = 4096


class Later:
    """An event that is done once told so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def manifest(layout: str, dtype: str, tokens: int) -> protocol.Manifest:
    g = BlockLayout(layout, 16, 3, 64, dtype)  # type: ignore[arg-type]
    return protocol.Manifest(
        request_id="r",
        token_ids=list(range(tokens)),
        layer_ids=[2, 5, 7],
        geometry=g,
        num_blocks=g.blocks_for(tokens),
    )
