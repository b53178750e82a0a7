"""Scheduler side: which readers the workers can reach, whether a new request may start,
and where each live request's sample stands.

Pure logic (no vllm, nixl or torch). The workers report, each step, changes of their link
to every reader and the requests that were delivered or failed (``DeliveryBook.update``).
From that:

* ``admit`` decides whether a new request starts now, waits (its reader is not reachable
  yet), or, after waiting ``connect_timeout_s``, starts without shipping and is failed:
  a waiting request holds no KV blocks, and a failed one reports why in its
  ``kv_transfer_params``;
* ``outcome`` says, when a request finishes, whether its sample was delivered, failed
  (and why), or is still on its way.
"""

from __future__ import annotations

import enum
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kv_connector.producer.options import Sharding
from kv_connector.producer.request_table import RequestRecord, RequestTable
from kv_connector.producer.worker_report import LinkChange
from kv_connector.wire.failure import FailureReason, SampleFailure
from kv_connector.wire.outcome import SampleStatus

NOT_REPORTED = "no worker has reported a connection yet"


class AdmissionKind(str, enum.Enum):
    RUN = "run"  # start now, ship to ``reader``
    WAIT = "wait"  # ask again next step (holding no blocks)
    FAIL = "fail"  # run without shipping; ``why`` goes into its kv_transfer_params


class Router:
    """Picks each sample's reader on the scheduler side, so every rank agrees.

    "request_hash": crc32 of the request id modulo the readers (stable across restarts);
    "round_robin": in the order requests start, skipping readers no worker can reach. A
    full reader only delays its own samples and a gone one only fails its own: each
    reader has its own sender per rank.
    """

    def __init__(self, readers: Sequence[str], policy: Sharding | str = Sharding.REQUEST_HASH) -> None:
        if not readers:
            raise ValueError("at least one reader")
        try:
            self.policy = Sharding(policy)
        except ValueError:
            raise ValueError(f"unknown sharding policy {policy!r}") from None
        self.readers = tuple(readers)
        self._next = 0

    @property
    def binds(self) -> bool:
        """Whether a request's reader is fixed before it runs (request_hash, or a single
        reader), so a request that fails still names the reader it was bound for."""
        return self.policy is Sharding.REQUEST_HASH or len(self.readers) == 1

    def route(self, request_id: str) -> str:
        """The reader of a request, whether or not it is reachable."""
        r = self.pick(request_id, lambda _: True)
        assert r is not None
        return r

    def pick(self, request_id: str, up: Callable[[str], bool]) -> str | None:
        """The reader of a request among those ``up``; None if its reader (request_hash)
        or every reader (round_robin) is down."""
        n = len(self.readers)
        if self.binds:
            r = self.readers[zlib.crc32(request_id.encode()) % n if n > 1 else 0]
            return r if up(r) else None
        for i in range(n):
            k = (self._next + i) % n
            if up(self.readers[k]):
                self._next = (k + 1) % n
                return self.readers[k]
        return None


@dataclass(frozen=True)
class Admission:
    kind: AdmissionKind
    reader: str | None = None  # with RUN: where its sample goes
    failure: SampleFailure | None = None  # with FAIL: why it runs without shipping

    @property
    def why(self) -> str:
        return self.failure.why if self.failure is not None else ""


class DeliveryBook:
    """Admission and outcomes. Its state of a request lives in the request's
    ``RequestRecord`` (shared with the planner through ``table``); the links of every
    (reader, rank) are its own."""

    def __init__(
        self,
        readers: Sequence[str],
        world_size: int,
        connect_timeout_s: float,
        router: Router | None = None,
        clock: Callable[[], float] = time.monotonic,
        table: RequestTable | None = None,
    ) -> None:
        if world_size <= 0:
            raise ValueError("world size must be positive")
        self.readers = list(readers)
        self.world_size = world_size
        self.connect_timeout_s = connect_timeout_s
        self.router = router or Router(self.readers)
        self.table = table if table is not None else RequestTable()
        self._clock = clock
        self._links: dict[tuple[str, int], str | None] = {}  # (reader, rank) -> None: connected

    # ------------------------------------------------------------ worker reports
    def update(
        self,
        links: Iterable[LinkChange | tuple[str, int, str | None]],
        failures: Mapping[str, SampleFailure],
        delivered: Iterable[str],
    ) -> list[tuple[str, SampleFailure]]:
        """Take one step's reports; returns the failures of requests that already
        finished (their kv_transfer_params are gone: the caller logs them)."""
        for reader, rank, error in links:
            if reader in self.readers and 0 <= rank < self.world_size:
                self._links[(reader, rank)] = error
        late = []
        for rid, failure in failures.items():
            rec = self.table.get(rid)
            if rec is None:
                late.append((rid, failure))
            elif rec.failed is None:
                rec.failed = failure
        for rid in delivered:
            rec = self.table.get(rid)
            if rec is not None:
                rec.delivered = True
        return late

    def is_up(self, reader: str) -> bool:
        """Every rank reported a working connection to this reader."""
        return all(self._links.get((reader, r), NOT_REPORTED) is None for r in range(self.world_size))

    def link_error(self, reader: str) -> str:
        for r in range(self.world_size):
            err = self._links.get((reader, r), NOT_REPORTED)
            if err is not None:
                return f"rank {r}: {err}" if self.world_size > 1 else err
        return ""

    # ---------------------------------------------------------- request life
    def add(self, request_id: str) -> None:
        self.table.ensure(request_id)

    def refuse(self, request_id: str, why: str) -> None:
        """The request cannot be shipped at all (e.g. its id, or a bad sample id or metadata
        in its kv_transfer_params): it fails at admission, alone, and its kv_transfer_params
        say why."""
        rec = self.table.ensure(request_id)
        rec.failed = SampleFailure(FailureReason.REQUEST_ID, why)
        self._bind(rec)

    def admit(self, request_id: str) -> Admission:
        """Called each step while a new request waits to start (and again if it is
        preempted and recomputed: an admitted request always runs)."""
        rec = self.table.get(request_id)
        if rec is not None and rec.admitted and rec.reader is not None:
            return Admission(AdmissionKind.RUN, rec.reader)
        if rec is not None and rec.failed is not None:
            return Admission(AdmissionKind.FAIL, failure=rec.failed)
        now = self._clock()
        since = now
        if rec is not None:
            if rec.waiting_since is None:
                rec.waiting_since = now
            since = rec.waiting_since
        reader = self.router.pick(request_id, self.is_up)
        if reader is not None:
            if rec is not None:
                rec.waiting_since = None
                rec.admitted, rec.reader = True, reader
            return Admission(AdmissionKind.RUN, reader)
        if now - since < self.connect_timeout_s:
            return Admission(AdmissionKind.WAIT)
        if self.router.binds:
            r = self.router.route(request_id)
            why = (
                f"cannot reach the reader at {r} for {self.connect_timeout_s:.0f} s "
                f"(last error: {self.link_error(r)})"
            )
        else:
            why = (
                f"cannot reach any reader ({', '.join(self.readers)}) for {self.connect_timeout_s:.0f} s "
                f"(last error: {self.link_error(self.readers[0])})"
            )
        failure = SampleFailure(FailureReason.UNREACHABLE, why)
        if rec is not None:
            rec.waiting_since = None
            rec.failed = failure
            self._bind(rec)
        return Admission(AdmissionKind.FAIL, failure=failure)

    def started(self, request_id: str) -> str | None:
        """vLLM scheduled the request: one it ran without admitting (it overrides the
        connector's "not yet" for requests that skip the prefix cache, such as those
        asking for ``prompt_logprobs``) is bound now, to a reader that is up or else to
        the one it routes to, whose sender ships it once connected. The reader it bound
        such a request to; None for any other."""
        rec = self.table.get(request_id)
        if rec is None or rec.admitted or rec.failed is not None:
            return None
        reader = self.router.pick(request_id, self.is_up) or self.router.route(request_id)
        rec.waiting_since = None
        rec.admitted, rec.reader = True, reader
        return reader

    def _bind(self, rec: RequestRecord) -> None:
        """A request that fails before it ran keeps the reader it was bound for, where
        the policy binds one (its kv_transfer_params name it); round robin binds none."""
        if rec.reader is None and self.router.binds:
            rec.reader = self.router.route(rec.request_id)

    def outcome(self, request_id: str) -> tuple[SampleStatus, str]:
        """Where the request's sample stands now, and why it failed ("" unless failed):
        pending means still on its way (a later failure is logged by the scheduler with
        the request id)."""
        rec = self.table.get(request_id)
        if rec is not None and rec.failed is not None:
            return SampleStatus.FAILED, rec.failed.why
        if rec is not None and rec.delivered:
            return SampleStatus.DELIVERED, ""
        return SampleStatus.PENDING, ""

    def finish(self, request_id: str) -> None:
        """The request finished: forget it (later reports about it are "late")."""
        self.table.remove(request_id)

    def __len__(self) -> int:
        return len(self.table)
