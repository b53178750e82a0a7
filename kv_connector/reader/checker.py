"""The reader's checking thread: each rank's share of a sample is checked against its
digest as soon as it has landed (``Verify`` actions of the ledger), here, off the
serving thread and off the user's (XXH3 releases the GIL while it hashes; a share of
block digests, from a producer whose cache is on a GPU, is recomputed with torch), so that
handing a sample out costs nothing per byte. Results go back to the ledger."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable

import torch

from kv_connector.reader.lease import sample_view
from kv_connector.reader.ledger import ReaderLedger
from kv_connector.reader.records import Action, Verify
from kv_connector.wire.block_digest import sample_block_digests, share_digest
from kv_connector.wire.integrity import sample_checksum
from kv_connector.wire.protocol import Manifest, ShareChecksum

log = logging.getLogger("kv_connector.reader.reader")


def pool_checksum(pool: memoryview, base: int, m: Manifest, blocks: list[int], kind: ShareChecksum) -> int:
    """The checksum of a share (``blocks``, indices in the sample) recomputed from a pool
    whose run of the sample starts at byte ``base``, as ``kind`` says: XXH3-64 of its
    bytes (``integrity``), or of its block digests recomputed on CPU (``block_digest``).
    The push reader's check and the pull client's."""
    if kind is ShareChecksum.BLOCKS:
        n = m.geometry.sample_bytes(m.num_blocks)
        states = sample_view(torch.frombuffer(pool, dtype=torch.uint8, offset=base, count=n), m)
        return share_digest(m, blocks, sample_block_digests(states, m, blocks))
    return sample_checksum(pool, base, m, blocks)


class ShareChecker:
    def __init__(
        self,
        pool: memoryview,
        ledger: ReaderLedger,
        lock: threading.RLock,
        perform: Callable[[Iterable[Action]], None],
    ) -> None:
        self._pool = pool
        self._ledger = ledger
        self._lock = lock
        self._perform = perform
        self._q: queue.SimpleQueue[Verify | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="hs-reader-check", daemon=True)
        self._thread.start()

    def submit(self, v: Verify) -> None:
        self._q.put(v)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while (v := self._q.get()) is not None:
            try:
                self._check(v)
            except Exception:  # a check that cannot run must not stop the others
                log.exception("hidden-states reader: checking %s rank %d failed", v.key, v.rank)

    def _check(self, v: Verify) -> None:
        with self._lock:
            s = self._ledger.samples.get(v.key)
            share = s.shares.get(v.rank) if s is not None else None
            if s is None or share is None or s.pages is None or share.checking != v.landing:
                return  # gone, or landed again since: a newer check is queued
            page_bytes = self._ledger.page_bytes
            assert page_bytes is not None
            base, manifest, blocks = s.pages.start * page_bytes, s.manifest, sorted(share.blocks)
        t0 = time.perf_counter()
        got = pool_checksum(self._pool, base, manifest, blocks, v.checksum)
        ok, seconds = got == v.digest, time.perf_counter() - t0
        with self._lock:
            self._perform(self._ledger.share_checked(v.key, v.rank, v.landing, ok, time.monotonic(), seconds))
