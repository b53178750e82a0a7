"""Scheduler side: where each live request's sample stands, in both delivery modes.

Pure logic: no vllm, nixl or torch. A mode's ``admit`` decides whether a new request
starts now or waits. After waiting ``connect_timeout_s`` it starts without shipping and
is failed (``DeliveryBook.run``, ``wait_or_fail``). A waiting request holds no KV blocks,
and a failed one reports why in its ``kv_transfer_params``. Each step the workers report
the requests that were delivered or failed (``update``). When a request finishes,
``outcome`` says whether its sample was delivered, failed (and why), or is still on its
way.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kv_connector.producer.request_table import RequestTable
from kv_connector.wire.failure import FailureReason, SampleFailure
from kv_connector.wire.outcome import SampleStatus


class AdmissionKind(str, enum.Enum):
    # start now (push: ship to ``reader``)
    RUN = "run"
    # ask again next step (holding no blocks)
    WAIT = "wait"
    # run without shipping; ``why`` goes into its kv_transfer_params
    FAIL = "fail"


@dataclass(frozen=True)
class Admission:
    kind: AdmissionKind
    # with RUN: where its sample goes (push)
    reader: str | None = None
    # with FAIL: why it runs without shipping
    failure: SampleFailure | None = None

    @property
    def why(self) -> str:
        return self.failure.why if self.failure is not None else ""


class DeliveryBook:
    """Admission answers and outcomes. Its state of a request lives in the request's
    ``RequestRecord``, shared with the planner through ``table``."""

    def __init__(
        self,
        connect_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        table: RequestTable | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.table = table if table is not None else RequestTable()
        self._clock = clock

    # ------------------------------------------------------------ worker reports
    def update(
        self, failures: Mapping[str, SampleFailure], delivered: Iterable[str]
    ) -> list[tuple[str, SampleFailure]]:
        """Take one step's reports; returns the failures of requests that already
        finished (their kv_transfer_params are gone: the caller logs them)."""
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

    # ---------------------------------------------------------- request life
    def add(self, request_id: str) -> None:
        self.table.ensure(request_id)

    def refuse(self, request_id: str, why: str) -> None:
        """The request cannot be shipped at all; it fails at admission, alone.

        The cause is its id, or a bad sample id or metadata in its kv_transfer_params, and
        its kv_transfer_params say why."""
        self.table.ensure(request_id).failed = SampleFailure(FailureReason.REQUEST_ID, why)

    def decided(self, request_id: str) -> Admission | None:
        """The answer a request already has, or None.

        An admitted request always runs, even when it is preempted and recomputed; a failed
        one runs without shipping."""
        rec = self.table.get(request_id)
        if rec is not None and rec.admitted:
            return Admission(AdmissionKind.RUN, rec.reader)
        if rec is not None and rec.failed is not None:
            return Admission(AdmissionKind.FAIL, failure=rec.failed)
        return None

    def run(self, request_id: str, reader: str | None) -> Admission:
        """The request starts now (push: bound to ``reader``)."""
        rec = self.table.get(request_id)
        if rec is not None:
            rec.waiting_since = None
            rec.admitted, rec.reader = True, reader
        return Admission(AdmissionKind.RUN, reader)

    def wait_or_fail(self, request_id: str, why: Callable[[], str]) -> Admission:
        """The request cannot start yet: it waits up to ``connect_timeout_s``, then fails with ``why()``.

        The wait counts from the first time it was asked about."""
        rec = self.table.get(request_id)
        now = since = self._clock()
        if rec is not None:
            if rec.waiting_since is None:
                rec.waiting_since = now
            since = rec.waiting_since
        if now - since < self.connect_timeout_s:
            return Admission(AdmissionKind.WAIT)
        failure = SampleFailure(FailureReason.UNREACHABLE, why())
        if rec is not None:
            rec.waiting_since = None
            rec.failed = failure
        return Admission(AdmissionKind.FAIL, failure=failure)

    def outcome(self, request_id: str) -> tuple[SampleStatus, str]:
        """Where the request's sample stands now, and why it failed ("" unless failed).

        Pending means still on its way; the scheduler logs a later failure with the request id."""
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
