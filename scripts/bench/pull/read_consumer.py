"""The consumer process of the READ pairings, both arms: a ``PullClient`` (defaults:
fingerprints checked, the values screen, samples on lease) and a raw NIXL agent with a
registered buffer of the same size, READing the same blocks with no protocol."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from scripts.bench import paired
from scripts.bench.pull.child import serve_commands
from scripts.bench.pull.shape import BLOCK, LAYER_IDS, digest


@dataclass
class _RawRound:
    """One round of plain READs: the READs in flight (transfer, sample, slot), the checks
    running (future, slot), the slots free."""

    free: list[int]
    live: list[tuple[Any, int, int]] = field(default_factory=list)
    checking: list[tuple[Future[None], int]] = field(default_factory=list)
    moved: int = 0
    digests: list[tuple[int, str]] = field(default_factory=list)


class _Consumer:
    def __init__(self, pool_bytes: int, in_flight: int, check_values: bool) -> None:
        import torch

        from kv_connector.common.memory import host_memory
        from kv_connector.reader import PullClient
        from kv_connector.wire.nixl_transport import NixlTransport

        self.pool_bytes, self.in_flight = pool_bytes, in_flight
        self.client = PullClient(pool_bytes=pool_bytes, check_values=check_values)
        self.raw = NixlTransport(f"bench-raw-{os.getpid()}")
        self.buf_np = host_memory(pool_bytes)  # the same kind of memory as the client's pool
        self.buf = torch.from_numpy(self.buf_np)
        self.local = self.raw.register(self.buf)
        self.checker = ThreadPoolExecutor(1)
        self.state: dict[str, Any] = {}

    def setup(self, info: dict[str, Any]) -> None:
        from kv_connector.wire.transport import Region

        self.state["peer"] = self.raw.add_peer(info["metadata"])
        self.state["remote"] = Region(info["addr"], info["nbytes"], "DRAM", 0)
        self.state["block_bytes"] = info["block_bytes"]

    def pull(self, handles: list[str], verify: bool) -> tuple[float, int, float, list[str]]:
        import torch

        from kv_connector.reader import FetchError

        moved, digests = 0, []
        c0, t0 = paired.cpu_seconds(), time.perf_counter()
        for s in self.client.fetch_iter(handles, self.in_flight):  # READs ahead, checks beside them
            if isinstance(s, FetchError):
                raise s
            hs = s.hidden_states
            moved += -(-hs.shape[0] // BLOCK) * self.state["block_bytes"]  # what was READ: whole blocks
            if verify:
                digests.append(digest(hs.contiguous().view(torch.uint8).numpy().reshape(-1)))
            del hs
            s.release()
        t1 = time.perf_counter()
        return t1 - t0, moved, paired.cpu_seconds() - c0, digests

    def check(self, at: int, tokens: int, hidden: int) -> None:
        """What the client checks of a sample by default: its fingerprint (the sampled words
        of every token slot, gathered where the sample lies, and their hash) and the sampled
        values screen."""
        import torch

        from kv_connector.reader import find_bad_values

        row = len(LAYER_IDS) * hidden * 2
        states = self.buf[at : at + tokens * row].view(torch.bfloat16).view(tokens, len(LAYER_IDS), hidden)
        _fingerprint(states)
        assert find_bad_values(states, LAYER_IDS, sample=True) is None

    def read_raw(
        self, blocks: list[list[int]], tokens: int, verify: bool, checks: bool = False
    ) -> tuple[float, int, float, list[str]]:
        """Plain READs of each sample's blocks, ``in_flight`` at a time; with ``checks``,
        each sample is checked as the client checks it (``check``) on a thread of its own
        once its READ completed, and its slot is read into again only after that."""
        sample_bytes = len(blocks[0]) * self.state["block_bytes"]
        slots = self.pool_bytes // sample_bytes
        if slots < 1:
            raise ValueError("the buffer holds no sample")
        row = sample_bytes // (len(blocks[0]) * BLOCK)
        hidden = row // (len(LAYER_IDS) * 2)
        r = _RawRound(free=list(range(min(slots, self.in_flight))))
        c0, t0 = paired.cpu_seconds(), time.perf_counter()
        i = 0
        while i < len(blocks) or r.live or r.checking:
            while i < len(blocks) and r.free:
                slot = r.free.pop()
                r.live.append((self._read(blocks[i], slot * sample_bytes), i, slot))
                i += 1
            self._reap(r, sample_bytes, verify, checks, tokens, hidden)
            if r.checking and not r.live and (not r.free or i >= len(blocks)):
                r.checking[0][0].result()  # nothing to READ until a check ends: wait, do not spin
            for f, slot in [c for c in r.checking if c[0].done()]:
                f.result()
                r.checking.remove((f, slot))
                r.free.append(slot)
        for f, _slot in r.checking:
            f.result()
        t1 = time.perf_counter()
        return t1 - t0, r.moved, paired.cpu_seconds() - c0, [d for _, d in sorted(r.digests)]

    def _read(self, blocks: list[int], at: int) -> Any:
        """Start the READs of one sample's blocks into the buffer at ``at``."""
        import numpy as np

        bb = self.state["block_bytes"]
        spans = np.array([(at + k * bb, b * bb, bb) for k, b in enumerate(blocks)])
        return self.raw.read(self.state["peer"], self.local, self.state["remote"], spans)

    def _reap(
        self,
        r: _RawRound,
        sample_bytes: int,
        verify: bool,
        checks: bool,
        tokens: int,
        hidden: int,
    ) -> None:
        """The READs that completed: counted, digested (``verify``), and their slots
        checked (``checks``) or freed."""
        still = []
        for x, j, slot in r.live:
            if not self.raw.poll(x):
                still.append((x, j, slot))
                continue
            r.moved += sample_bytes
            at = slot * sample_bytes
            if verify:
                r.digests.append((j, digest(self.buf_np[at : at + tokens * len(LAYER_IDS) * hidden * 2])))
            if checks:
                r.checking.append((self.checker.submit(self.check, at, tokens, hidden), slot))
            else:
                r.free.append(slot)
        r.live = still

    def profile(self, tokens: int, hidden: int) -> dict[str, float]:
        """Milliseconds per sample (best of 3) of the client's default checks, the
        fingerprint and the sampled values screen, and of the diagnostic modes' XXH3 of the
        bytes and full values check, beside a plain copy of the same bytes."""
        import torch
        import xxhash

        from kv_connector.reader import find_bad_values

        x = torch.empty(tokens, len(LAYER_IDS), hidden, dtype=torch.bfloat16).uniform_(0.5, 1.5)
        y = torch.empty_like(x)
        raw_bytes = x.view(torch.uint8).numpy().reshape(-1).data
        return {
            "fingerprint_ms": _best(lambda: _fingerprint(x)),
            "values_screen_ms": _best(lambda: find_bad_values(x, LAYER_IDS, sample=True)),
            "xxh3_ms": _best(lambda: xxhash.xxh3_64_intdigest(raw_bytes)),
            "values_check_ms": _best(lambda: find_bad_values(x, LAYER_IDS)),
            "copy_ms": _best(lambda: y.copy_(x)),
        }

    def close(self) -> None:
        self.checker.shutdown()
        self.client.close()
        self.raw.close()


def _fingerprint(states: Any) -> int:
    """A sample's fingerprint as the client recomputes it (``wire.fingerprint``, less the
    manifest's few bytes): the sampled words of its token slots, gathered where they lie."""
    import numpy as np
    import xxhash

    from kv_connector.wire import fingerprint

    tokens = np.arange(states.shape[0], dtype=np.int64)
    words = fingerprint.gather(fingerprint.as_words(states), (tokens,), tokens, 1, BLOCK, len(tokens) - 1)
    return xxhash.xxh3_64_intdigest(words.numpy().tobytes())


def _best(fn: Callable[[], object]) -> float:
    """The fastest of 3 calls after a first, in milliseconds."""
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times) * 1e3, 2)


def consumer_proc(conn: Any, pool_bytes: int, in_flight: int, check_values: bool) -> None:
    """The process: a ``_Consumer`` answering "setup", "pull", "raw" and "profile" until
    "quit"."""
    c = _Consumer(pool_bytes, in_flight, check_values)
    try:
        serve_commands(conn, {"setup": c.setup, "pull": c.pull, "raw": c.read_raw, "profile": c.profile})
    finally:
        c.close()
