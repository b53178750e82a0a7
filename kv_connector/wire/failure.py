"""Why a sample failed, as one typed value from where it fails to the metrics: the
reason (a ``FailureReason``, the label of ``vllm:hidden_states_samples_failed``) and the
text users read in ``kv_transfer_params``. Pure logic."""

from __future__ import annotations

import enum
from typing import NamedTuple

from kv_connector.wire.protocol import RefuseCode


class FailureReason(enum.Enum):
    """Why a sample failed (a metric's label)."""

    # no working reader for connect_timeout_s
    UNREACHABLE = "unreachable"
    # the reader refused it (e.g. larger than its pool)
    REFUSED = "refused"
    # its bytes failed the reader's checksum too many times
    CHECKSUM = "checksum"
    # NIXL WRITEs failed (this rank's, or another rank's)
    WRITE_FAILED = "write_failed"
    # not complete by its deadline (sample_timeout_s after its grant)
    TIMEOUT = "timeout"
    # preempted before its share was safely written
    PREEMPTED = "preempted"
    # vLLM went to sleep (sleep mode) before the reader acknowledged it
    ASLEEP = "asleep"
    # its request id cannot name a sample (refused at admission)
    REQUEST_ID = "request_id"
    # the slot mapping disagreed, its checksum failed, the sender stopped
    OTHER = "other"


class SampleFailure(NamedTuple):
    reason: FailureReason
    why: str


_REFUSED: dict[str, FailureReason] = {
    "checksum": FailureReason.CHECKSUM,
    # another rank's WRITEs failed
    "write_failed": FailureReason.WRITE_FAILED,
    "timeout": FailureReason.TIMEOUT,
    "preempted": FailureReason.PREEMPTED,
}


def refused(code: RefuseCode) -> FailureReason:
    """The reason of a sample its reader refused with ``code``."""
    return _REFUSED.get(code, FailureReason.REFUSED)
