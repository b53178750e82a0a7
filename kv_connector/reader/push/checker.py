"""The reader's checking thread: each rank's share is checked against its digest once it landed.

Checking here, off the serving thread and off the user's, means handing a sample out costs
nothing per byte. The ledger asks for each check with a ``Verify`` action, and the results
go back to it. XXH3 releases the GIL while it hashes. A share of block digests, from a
producer whose cache is on a GPU, is recomputed from the pool where it lies
(``pool.memory``).

``screen`` is the reader's sampled values screen. With it, a fingerprinted share's rows are
screened on the lines its check reads anyway (``pool.memory.fingerprint_screened``). Its
hand-out then reads nothing more, unless the screen said to look closer.

A fingerprinted share in a host pool is checked on the thread that learned it landed. Its
check reads a few words a token, less than the hand-off to this thread costs.
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
            where = self._ledger.share_to_check(v)
        if where is None:
            return  # gone, or landed again since: a newer check is queued
        t0 = time.perf_counter()
        got, screen = check_share(
            self._pool, where.base, where.manifest, list(where.blocks), v.checksum, self._screen
        )
        ok, seconds = got == v.digest, time.perf_counter() - t0
        with self._lock:
            now = time.monotonic()
            self._perform(self._ledger.share_checked(v.key, v.rank, v.landing, ok, now, seconds, screen))
