"""The reader's checking thread: each rank's share of a sample is checked against its
digest as soon as it has landed (``Verify`` actions of the ledger), here, off the
serving thread and off the user's (XXH3 releases the GIL while it hashes; a share of
block digests, from a producer whose cache is on a GPU, is recomputed from the pool where
it lies: ``pool.memory``), so that handing a sample out costs nothing per byte. With
``screen`` (the reader's sampled values screen), a fingerprinted share's rows are
screened on the lines its check reads anyway (``pool.memory.fingerprint_screened``), and
its hand-out reads nothing more unless they said to look closer. Results go back to the
ledger. A fingerprinted share in a host pool is checked on the thread that learned it
landed: its check reads a few words a token, less than the hand-off to this thread costs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable

from kv_connector.common.device import on_device
from kv_connector.reader.pool.memory import PoolMemory, check_share
from kv_connector.reader.push.ledger import ReaderLedger
from kv_connector.reader.push.records import Action, Verify
from kv_connector.wire.protocol import ShareChecksum

log = logging.getLogger("kv_connector.reader.push.reader")


class ShareChecker:
    def __init__(
        self,
        pool: PoolMemory,
        ledger: ReaderLedger,
        lock: threading.RLock,
        perform: Callable[[Iterable[Action]], None],
        screen: bool = False,
    ) -> None:
        self._pool = pool
        self._screen = screen
        self._ledger = ledger
        self._lock = lock
        self._perform = perform
        self._q: queue.SimpleQueue[Verify | None] = queue.SimpleQueue()
        self._inline = pool.device.type == "cpu"  # host memory: nothing waits for a GPU's stream
        self._thread = threading.Thread(target=self._run, name="hs-reader-check", daemon=True)
        self._thread.start()

    def submit(self, v: Verify) -> None:
        """Check a fingerprinted share of a host pool now, on the caller's thread; queue the others."""
        if self._inline and v.checksum is ShareChecksum.FINGERPRINT:
            self._check_logged(v)
        else:
            self._q.put(v)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        on_device(self._pool.device)  # a pool on a GPU is checked there
        while (v := self._q.get()) is not None:
            self._check_logged(v)

    def _check_logged(self, v: Verify) -> None:
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
        got, screen = check_share(self._pool, base, manifest, blocks, v.checksum, self._screen)
        ok, seconds = got == v.digest, time.perf_counter() - t0
        with self._lock:
            now = time.monotonic()
            self._perform(self._ledger.share_checked(v.key, v.rank, v.landing, ok, now, seconds, screen))
