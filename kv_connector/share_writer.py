"""The sender's WRITE path: posts the WRITEs its job ledger says are due into the pages
the reader granted, polls them, and hands completions and failures back to the ledger.
One per sender; it works on the current connection's reader (``connect``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from kv_connector import protocol
from kv_connector.layout import piece_spans
from kv_connector.send_ledger import Failure, Job, SendLedger
from kv_connector.transport import Region, Transport, TransportError

log = logging.getLogger("kv_connector.sender")

SETTLE_S = 5.0  # after a lost connection, how long a WRITE in flight may take to settle


class ShareWriter:
    def __init__(
        self,
        transport: Transport,
        local: Region,
        ledger: SendLedger,
        lock: threading.Lock,
        rank: int,
        tell_reader: Callable[[Failure], None],
    ) -> None:
        self._transport = transport
        self._local = local
        self._ledger = ledger
        self._lock = lock
        self._rank = rank
        self._tell_reader = tell_reader
        self._peer = ""
        self._remote: Region | None = None
        self.page_bytes = 0

    def connect(self, peer: str, remote: Region, page_bytes: int) -> None:
        """WRITE to ``peer``'s ``remote`` pool, cut in pages of ``page_bytes``."""
        self._peer, self._remote, self.page_bytes = peer, remote, page_bytes

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
        """(cache offset, pool offset, length) of every piece of the job's share."""
        m, grant = job.manifest, job.grant
        assert grant is not None
        pieces = piece_spans(m.block_bytes, self.page_bytes)
        ppb = len(pieces)
        js = np.fromiter(job.share, dtype=np.int64)
        blocks = np.asarray(job.block_ids, dtype=np.int64)[js]
        pages = np.asarray(grant.pages, dtype=np.int64).reshape(m.num_blocks, ppb)[js]
        offs = np.array([o for o, _ in pieces], dtype=np.int64)
        lens = np.array([n for _, n in pieces], dtype=np.int64)
        spans = np.empty((len(js), ppb, 3), dtype=np.int64)
        spans[:, :, 0] = blocks[:, None] * m.block_bytes + offs[None, :]
        spans[:, :, 1] = pages * self.page_bytes
        spans[:, :, 2] = lens[None, :]
        return spans.reshape(-1, 3)

    def _post(self, job: Job) -> None:
        assert self._remote is not None
        notif = protocol.encode(protocol.WriteDone(request_id=job.request_id, checksum=job.digest))
        now = time.monotonic()
        try:
            xfer = self._transport.write(self._peer, self._local, self._remote, self.spans(job), notif)
        except TransportError as e:
            with self._lock:
                self._ledger.write_posted(job.request_id, None, now)
                failure = self._ledger.write_failed(job.request_id, str(e), now)
            self._failed(job.request_id, e, failure)
            return
        with self._lock:
            self._ledger.write_posted(job.request_id, xfer, now)

    def poll(self) -> bool:
        """Poll every WRITE in flight once; True if any completed."""
        with self._lock:
            writing = [(j.request_id, j.xfer) for j in self._ledger.writes_in_flight()]
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
        """The connection is lost: let the WRITEs in flight finish or fail (up to
        ``SETTLE_S`` each) before the ledger forgets them; then forget the reader."""
        with self._lock:
            writing = [j.xfer for j in self._ledger.writes_in_flight()]
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

    def _failed(self, rid: str, e: TransportError, failure: Failure | None) -> None:
        if failure is None:
            log.warning("rank %d: WRITE of %s failed in NIXL (%s); posting it again", self._rank, rid, e)
            return
        log.error("request %s failed: %s", rid, failure.why)
        self._tell_reader(failure)
