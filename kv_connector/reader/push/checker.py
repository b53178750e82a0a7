"""The reader's checking thread: each rank's share is checked against its checksum once it landed.

Checking here, off the serving thread and off the user's, means handing a sample out costs
nothing per byte. The ledger asks for each check with a ``CheckShare`` action, and the results
go back to it. XXH3 releases the GIL while it hashes. A share of block digests, from a
producer whose cache is on a GPU, is recomputed from the pool where it lies
(``pool.memory``).

``screen`` is the reader's sampled values screen. With it, a fingerprinted share's rows are
screened on the lines its check reads anyway (``pool.memory.fingerprint_screened``). Its
hand-out then reads nothing more, unless the screen said to look closer.

A fingerprinted share in a host pool is checked on the thread that learned it landed. Its
check reads a few words a token, less than the hand-off to this thread costs. In a device
pool, that thread queues the check on the pool's stream (``DevicePool.queue_fingerprint``)
and reads its result when the check's event says it is done, in a later turn of its busy
poll (``settle``): no thread waits for the device and none is handed the sample. The other
kinds (block digests, XXH3) run here.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable

from kv_connector.common.device import on_device
from kv_connector.reader.pool.memory import DevicePool, LeaseFences, PoolMemory, QueuedCheck, check_share
from kv_connector.reader.pool.values import RowsScreen
from kv_connector.reader.push.ledger import ReaderLedger
from kv_connector.reader.push.records import Action, CheckShare
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
        self._q: queue.SimpleQueue[CheckShare | None] = queue.SimpleQueue()
        # a device pool (a GPU's, or CI's on the host) queues a fingerprint check on its stream
        self._device_pool = pool if isinstance(pool, DevicePool) else None
        # checks queued on the device, with their events
        self._queued = LeaseFences(pool.device)
        # host memory: nothing waits for a GPU's stream
        self._inline = pool.device.type == "cpu"
        self._thread = threading.Thread(target=self._run, name="hs-reader-check", daemon=True)
        self._thread.start()

    def submit(self, job: CheckShare) -> None:
        """Check a fingerprinted share now on the caller's thread (a host pool), or queue it
        on the device pool's stream (read by ``settle``); hand the others to this thread."""
        if job.checksum_kind is not ShareChecksum.FINGERPRINT:
            self._q.put(job)
        elif self._device_pool is not None:
            self._logged(job, self._queue)
        elif self._inline:
            self._logged(job, self._check)
        else:
            self._q.put(job)

    @property
    def waiting(self) -> int:
        """Checks queued on the device and not read yet."""
        return self._queued.waiting

    def settle(self) -> int:
        """Read the queued checks whose work is done (call with the lock held, as the
        serving thread's busy poll does); returns how many still wait."""
        return self._queued.settle()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        # a pool on a GPU is checked there
        on_device(self._pool.device)
        while (v := self._q.get()) is not None:
            self._logged(v, self._check)

    def _logged(self, job: CheckShare, step: Callable[..., None], *args: object) -> None:
        """``step(job, *args)``; a check that cannot run is logged and must not stop the others."""
        try:
            step(job, *args)
        except Exception:
            log.exception("hidden-states reader: checking %s rank %d failed", job.key, job.rank)

    def _queue(self, job: CheckShare) -> None:
        assert self._device_pool is not None
        with self._lock:
            where = self._ledger.view.share_to_check(job)
        if where is None:
            # gone, or landed again since: a newer check is queued
            return
        t0 = time.perf_counter()
        pool, blocks = self._device_pool, list(where.blocks)
        queued = pool.queue_fingerprint(where.base, where.manifest, blocks, self._screen)
        self._queued.add(functools.partial(self._logged, job, self._read, queued, t0), queued.event)

    def _read(self, job: CheckShare, queued: QueuedCheck, t0: float) -> None:
        got, screen = queued.result()
        self._checked(job, got == job.checksum, time.perf_counter() - t0, screen)

    def _checked(self, job: CheckShare, ok: bool, seconds: float, screen: RowsScreen | None) -> None:
        with self._lock:
            now = time.monotonic()
            self._perform(
                self._ledger.share_checked(job.key, job.rank, job.landing, ok, now, seconds, screen)
            )

    def _check(self, job: CheckShare) -> None:
        with self._lock:
            where = self._ledger.view.share_to_check(job)
        if where is None:
            # gone, or landed again since: a newer check is queued
            return
        t0 = time.perf_counter()
        got, screen = check_share(
            self._pool, where.base, where.manifest, list(where.blocks), job.checksum_kind, self._screen
        )
        self._checked(job, got == job.checksum, time.perf_counter() - t0, screen)
