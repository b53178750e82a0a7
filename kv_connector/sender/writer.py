"""The sender's WRITE path, on a thread of its own: posts the WRITEs its job ledger says
are due into the run of pages the reader granted, polls them, and hands completions and
failures back to the ledger. A WRITE is posted synchronously by the transport (UCX moves
the bytes inside the call on some links), so this thread is not the one that serves the
reader's messages: grants, acks and checksums keep flowing meanwhile. One per sender; it
works on the current connection's reader (``connect`` ... ``settle``)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kv_connector.common.device import on_device
from kv_connector.common.poller import Poller
from kv_connector.sender.job_states import JobState
from kv_connector.sender.jobs import Failure, Job, log_failed
from kv_connector.sender.ledger import SendLedger
from kv_connector.wire import protocol
from kv_connector.wire.failure import FailureReason
from kv_connector.wire.layout import cache_spans
from kv_connector.wire.transport import Region, Transport, TransportError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kv_connector.sender.sender")

# after a lost connection, how long a WRITE in flight may take to settle
SETTLE_S = 5.0


class ShareWriter:
    def __init__(
        self,
        transport: Transport,
        local: Region,
        ledger: SendLedger,
        lock: threading.Lock,
        rank: int,
        tell_reader: Callable[[Failure], None],
        device: torch.device | None = None,
        block_pitch: int | None = None,
    ) -> None:
        self._device = device
        self._transport = transport
        # bytes from one cache block to the next; None: dense
        self._block_pitch = block_pitch
        self._local = local
        self._ledger = ledger
        self._lock = lock
        self._rank = rank
        self._tell_reader = tell_reader
        self._peer = ""
        self._remote: Region | None = None
        # WRITEs of failed jobs, polled to their end; then what follows (a fence, S9)
        self._orphans: list[tuple[object, Callable[[], None] | None]] = []
        self.page_bytes = 0
        # held for each round, and by connect / settle
        self._io = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._poller = Poller.from_env("KV_CONNECTOR_SENDER")
        self._thread = threading.Thread(target=self._run, name=f"hs-writer-r{rank}", daemon=True)
        self._thread.start()

    def connect(self, peer: str, remote: Region, page_bytes: int) -> None:
        """WRITE to ``peer``'s ``remote`` pool, cut in pages of ``page_bytes``."""
        with self._io:
            self._peer, self._remote, self.page_bytes = peer, remote, page_bytes
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def set_local(self, local: Region) -> None:
        """WRITE from ``local`` from now on (the cache registered again after a wake)."""
        with self._io:
            self._local = local

    def adopt(self, xfer: object, settled: Callable[[], None] | None = None) -> None:
        """A failed job's WRITE still in flight: poll it to its end (its handle is
        released then), whatever the ledger does; then call ``settled`` (not if the
        connection is lost first)."""
        with self._lock:
            self._orphans.append((xfer, settled))
        self.wake()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        # UCX keeps CUDA IPC on only in a thread with the cache's context
        on_device(self._device)
        while not self._closed:
            with self._lock:
                writing = self._ledger.writing or bool(self._orphans)
            self._wake.wait(self._poller.timeout(writing))
            self._wake.clear()
            busy = False
            with self._io:
                if self._peer and not self._closed:
                    try:
                        busy = self.start_due() | self.poll()
                    # never let one bad WRITE stop the thread
                    except Exception:
                        log.exception("rank %d: unexpected error in the WRITE path", self._rank)
                        time.sleep(0.01)
            self._poller.after(busy)

    @property
    def pool_bytes(self) -> int:
        assert self._remote is not None
        return self._remote.nbytes

    def start_due(self) -> bool:
        """Post the WRITE of every job the ledger says is due; True if any."""
        with self._lock:
            due = self._ledger.writes_due(time.monotonic())
        for job in due:
            self._post(job)
        return bool(due)

    def spans(self, job: Job) -> np.ndarray:
        """(cache offset, pool offset, length) of every piece of the job's share: each
        block where ``BlockLayout.arranged_spans`` puts it in the granted run, pieces that
        continue each other on both sides merged into one (``merge_runs``)."""
        m, grant = job.manifest, job.grant
        assert grant is not None
        g, nb = m.geometry, m.num_blocks
        pitch = self._block_pitch or g.block_bytes
        base = grant.first_page * self.page_bytes
        rows = np.asarray(cache_spans(g, nb, job.block_ids, job.share, pitch), dtype=np.int64).reshape(-1, 3)
        rows[:, 1] += base
        return rows

    def _post(self, job: Job) -> None:
        assert self._remote is not None
        rid = job.request_id
        now = time.monotonic()
        # due: GRANTED
        assert job.grant is not None
        # a lost connection may take the job's grant meanwhile
        generation = job.grant.generation
        with self._lock:
            notif = self._ledger.notification(rid)
            # WRITING before it may land (S3)
            self._ledger.write_posting(rid, now, notif)
        spans = self.spans(job)
        t_post = time.perf_counter()
        try:
            xfer = self._transport.write(self._peer, self._local, self._remote, spans, protocol.encode(notif))
        except Exception as e:
            # a bug: fail this job, not the thread
            if not isinstance(e, TransportError):
                log.exception("rank %d: cannot post the WRITE of %s", self._rank, rid)
                with self._lock:
                    failure = self._ledger.fail(
                        rid, f"cannot post its WRITE: {type(e).__name__}: {e}", FailureReason.OTHER
                    )
                if failure is not None:
                    self._tell_reader(failure)
                return
            with self._lock:
                writing = self._ledger.state_of(rid) is JobState.WRITING
                failure = self._ledger.write_failed(rid, str(e), now) if writing else None
            if writing:
                self._failed(rid, e, failure)
            return
        post_s = time.perf_counter() - t_post
        with self._lock:
            followed = self._ledger.write_started(rid, xfer, post_s)
        # the job failed while its WRITE was being posted: fenced once it ends
        if not followed:
            fence = Failure(rid, "", tell_reader=False, generation=generation)
            self.adopt(xfer, functools.partial(self._tell_reader, fence))

    def poll(self) -> bool:
        """Poll every WRITE in flight once; True if any completed."""
        with self._lock:
            writing = [(j.request_id, j.xfer) for j in self._ledger.writes_in_flight()]
            orphans, self._orphans = self._orphans, []
        self._settle_orphans(orphans, 0.0)
        done_any = False
        for rid, xfer in writing:
            if xfer is None:
                continue
            try:
                done = self._transport.poll(xfer)  # type: ignore[arg-type]
            except TransportError as e:
                with self._lock:
                    failure = (
                        self._ledger.write_failed(rid, str(e), time.monotonic())
                        if rid in self._ledger
                        else None
                    )
                self._failed(rid, e, failure)
                continue
            if done:
                with self._lock:
                    if rid in self._ledger:
                        self._ledger.write_completed(rid, xfer.nbytes, time.monotonic())  # type: ignore[attr-defined]
                done_any = True
        return done_any

    def settle(self) -> None:
        """The connection is lost: stop posting, let the WRITEs in flight finish or fail
        (up to ``SETTLE_S`` each) before the ledger forgets them; then forget the reader."""
        with self._io:
            with self._lock:
                writing = [j.xfer for j in self._ledger.writes_in_flight()]
                orphans, self._orphans = self._orphans, []
            self._settle_orphans(orphans, SETTLE_S)
            for xfer in writing:
                deadline = time.monotonic() + SETTLE_S
                while xfer is not None and time.monotonic() < deadline:
                    try:
                        if self._transport.poll(xfer):  # type: ignore[arg-type]
                            break
                    except TransportError:
                        break
            if self._peer:
                self._transport.remove_peer(self._peer)
            self._peer, self._remote = "", None

    def _settle_orphans(self, orphans: list[tuple[object, Callable[[], None] | None]], wait_s: float) -> None:
        """Poll WRITEs nobody else follows until they end (then what follows them is
        called) or ``wait_s`` passes; the ones left are kept for the next round (or
        dropped, when the connection is gone)."""
        deadline = time.monotonic() + wait_s
        while orphans:
            left = []
            for xfer, settled in orphans:
                try:
                    if not self._transport.poll(xfer):  # type: ignore[arg-type]
                        left.append((xfer, settled))
                        continue
                except TransportError:
                    # ended (failed); the transport released it
                    pass
                if settled is not None:
                    settled()
            orphans = left
            if time.monotonic() >= deadline:
                break
        if orphans and wait_s == 0.0:
            with self._lock:
                self._orphans.extend(orphans)

    def _failed(self, rid: str, error: TransportError, failure: Failure | None) -> None:
        if failure is None:
            log.warning("rank %d: WRITE of %s failed in NIXL (%s); posting it again", self._rank, rid, error)
            return
        log_failed(failure)
        self._tell_reader(failure)
