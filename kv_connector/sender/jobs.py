"""What the sender's job ledger (``ledger.py``; its machine is drawn and tabled in
``job_states.py``) keeps and answers: a job (one request of this rank), the checksum of
its share, the failure the shell reports to the reader, and the ledger's errors. Pure
data: no nixl, sockets, threads or clocks."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from kv_connector.common.errors import StateError
from kv_connector.sender.job_states import JobState
from kv_connector.wire import protocol
from kv_connector.wire.protocol import Grant, Manifest

log = logging.getLogger("kv_connector.sender")


class FrozenJob(StateError):
    """A Rewrite of a preempted job's share: its blocks hold another request's states now."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.request_id = request_id


class ChecksumState(enum.Enum):
    # checksums off, or an empty share: nothing to compute
    OFF = "off"
    # not started
    NEEDED = "needed"
    COMPUTING = "computing"
    READY = "ready"


@dataclass
class Job:
    """One request of this rank: ``share`` is the range of the sample's blocks it writes,
    ``block_ids`` the cache blocks of all the sample's blocks in order."""

    request_id: str
    manifest: Manifest
    block_ids: list[int]
    share: range
    t_submit: float
    state: JobState = JobState.WAITING
    grant: Grant | None = None
    checksum_state: ChecksumState = ChecksumState.OFF
    checksum: int | None = None
    # failed WRITEs on this connection
    attempts: int = 0
    retry_at: float = 0.0
    rewrite_due: bool = False
    ack_due: bool = False
    # preempted: its blocks are being reused; no WRITE may read them again
    frozen: bool = False
    # its step may still be running on the device: nothing reads its blocks yet
    held: bool = False
    t_granted: float = 0.0
    # requested or placed before: a resend asks for its pages again
    asked: bool = False
    # a WRITE went out saying its checksum follows; not sent yet
    checksum_owed: bool = False
    # since when it waits for a working reader
    t_wait: float = 0.0
    # when its last WRITE was posted, or completed
    t_write: float = 0.0
    # the shell's handle of the WRITE
    xfer: object | None = field(default=None, repr=False)

    @property
    def checksum_safe(self) -> bool:
        """Was the share's checksum (if any) taken from the blocks as they were written?"""
        return self.checksum_state in (ChecksumState.OFF, ChecksumState.READY)

    @property
    def safely_written(self) -> bool:
        """Its share is in the reader's pages: written, its checksum taken, no Rewrite due."""
        return self.state is JobState.WRITTEN and self.checksum_safe and not self.rewrite_due

    def notification(self) -> protocol.WriteDone:
        """What its next WRITE announces: the grant it writes into, and its checksum or
        that it follows."""
        assert self.grant is not None, "no WRITE without a grant (S2)"
        rid, gen = self.request_id, self.grant.generation
        if self.checksum_state is ChecksumState.READY:
            return protocol.WriteDone(request_id=rid, generation=gen, checksum=self.checksum)
        follows = self.checksum_state in (ChecksumState.NEEDED, ChecksumState.COMPUTING)
        return protocol.WriteDone(request_id=rid, generation=gen, checksum_follows=follows)

    def connection_lost(self) -> None:
        """WAITING again, to be resent: every grant of the lost connection is gone (S2)."""
        self.state, self.grant, self.xfer = JobState.WAITING, None, None
        self.attempts, self.rewrite_due, self.retry_at, self.checksum_owed = 0, False, 0.0, False


@dataclass(frozen=True)
class Failure:
    """A job failed with ``why``. ``tell_reader``: its credit request went out on the
    current connection, so the reader must drop its sample (``Refuse`` with ``code``)
    and tell the producer's other ranks."""

    request_id: str
    why: str
    tell_reader: bool
    code: protocol.RefuseCode = "write_failed"
    # the handle of a WRITE still in flight when the job failed: the shell polls it to
    # its end (the transport releases it then), nobody else does
    xfer: object | None = field(default=None, compare=False, repr=False)
    # the grant it had on the current connection: once no WRITE of it is in flight the
    # reader is told (``Fenced``), and only then gives its pages to another sample (S9)
    generation: int | None = field(default=None, compare=False)


def log_failed(*failures: Failure | None) -> None:
    """One error line per failed request, the same wherever a job fails (None: none)."""
    for f in failures:
        if f is not None:
            log.error("request %s failed: %s", f.request_id, f.why)
