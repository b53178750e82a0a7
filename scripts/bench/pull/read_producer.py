"""The producer process of the READ pairings: a ``PullServer`` (no vLLM) over a cache
tensor holding ``samples`` samples' blocks, scattered, GPU block layout (TLH); every
"hold" holds them all again under new handles, each with its fingerprint words (the
connector's default record) taken as the hold is made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scripts.bench import paired
from scripts.bench.pull.child import serve_commands
from scripts.bench.pull.shape import BLOCK, LAYER_IDS, digest, sample_tokens


class _Producer:
    def __init__(self, samples: int, tokens: int, hidden: int, seed: int, checksum: bool) -> None:
        import torch

        from kv_connector.producer.pull.server import PullServer, PullServerConfig
        from kv_connector.wire.layout import BlockLayout
        from kv_connector.wire.protocol import ShareChecksum

        self.tokens, self.hidden = tokens, hidden
        self.layout = layout = BlockLayout(
            layout="TLH", block_size=BLOCK, num_layers=len(LAYER_IDS), hidden_size=hidden, dtype="bfloat16"
        )
        nb = layout.blocks_for(tokens)
        num_blocks = samples * nb + 1
        self.cache = cache = torch.empty(num_blocks, *layout.block_shape(), dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(seed)
        cache[:1].uniform_(0.5, 1.5, generator=g)
        for b in range(1, num_blocks):  # finite, non-zero, every block different
            cache[b].copy_(cache[0]).add_(b / num_blocks)
        order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 unused
        self.blocks = [order[i * nb : (i + 1) * nb] for i in range(samples)]
        self.server = PullServer(
            cache,
            PullServerConfig(
                layout,
                tuple(LAYER_IDS),
                "bench-producer",
                ("127.0.0.1", 0),
                300.0,
                checksum=ShareChecksum.FINGERPRINT if checksum else None,  # the connector's default
            ),
        )
        self.rounds = 0
        from kv_connector.cache.blocks import CacheBlocks
        from kv_connector.producer.fingerprints import Fingerprints

        self.fingerprints = Fingerprints(CacheBlocks(cache, layout), BLOCK)

    def info(self) -> dict[str, Any]:
        return {
            "metadata": self.server.agent_metadata,
            "addr": self.server.region.addr,
            "nbytes": self.server.region.nbytes,
            "block_bytes": self.layout.block_bytes,
            "blocks": self.blocks,
            "cache_bytes": self.cache.numel() * self.cache.element_size(),
        }

    def hold(self) -> list[str]:
        from kv_connector.wire.handle import PullHandle, make_nonce

        self.rounds += 1
        handles, rids = [], []
        for i, bl in enumerate(self.blocks):
            rid, nonce = f"round{self.rounds}-sample{i}", make_nonce()
            # the fingerprint words, as the worker side takes them in the step that wrote the slots
            words = self.fingerprints.ship(rid, self.tokens, bl)
            self.server.hold(rid, nonce, sample_tokens(i, self.tokens), bl, words=words)
            rids.append(rid)
            handles.append(PullHandle("bench-producer", rid, nonce, [self.server.address]).encode())
        self.server.finished(rids)
        return handles

    def poll(self) -> tuple[int, int]:
        return len(self.server.take_freed()), self.server.held

    def raw(self, begin: bool) -> None:
        """The server's own progress thread polls while consumers read; the raw READs get
        the same (this NIXL has no progress thread: a target that never polls stalls). The
        default record hashes nothing here (its words were taken when the sample was held)."""
        self.server.keep_progress(begin)

    def digests(self) -> list[str]:
        """Each sample's bytes as [T, L, H] (its blocks in order, its tokens only)."""
        import torch

        row = len(LAYER_IDS) * self.hidden * 2
        flat = [self.cache[bl].contiguous().view(torch.uint8).numpy().reshape(-1) for bl in self.blocks]
        return [digest(f[: self.tokens * row]) for f in flat]


def producer_proc(conn: Any, samples: int, tokens: int, hidden: int, seed: int, checksum: bool) -> None:
    """The process: a ``_Producer`` answering "info", "hold", "poll", "raw", "cpu" and
    "digests" until "quit"."""
    p = _Producer(samples, tokens, hidden, seed, checksum)
    handlers: dict[str, Callable[..., Any]] = {
        "info": p.info,
        "hold": p.hold,
        "poll": p.poll,
        "raw": p.raw,
        "cpu": paired.cpu_seconds,
        "digests": p.digests,
    }
    try:
        serve_commands(conn, handlers)
    finally:
        p.server.close()
