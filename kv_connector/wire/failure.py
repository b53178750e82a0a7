"""Why a sample failed, as one typed value from where it fails to the metrics: the
reason (a ``FailureReason``, the label of ``vllm:hidden_states_samples_failed``) and the
text users read in ``kv_transfer_params``. Pure logic."""

from __future__ import annotations

import enum
from typing import NamedTuple

from kv_connector.wire.protocol import RefuseCode


class FailureReason(enum.Enum):
    """Why a sample failed (a metric's label)."""

    UNREACHABLE = "unreachable"  # no working reader for connect_timeout_s
    REFUSED = "refused"  # the reader refused it (e.g. larger than its pool)
    CHECKSUM = "checksum"  # its bytes failed the reader's checksum too many times
    WRITE_FAILED = "write_failed"  # NIXL WRITEs failed (this rank's, or another rank's)
    TIMEOUT = "timeout"  # not complete by its deadline (sample_timeout_s after its grant)
    PREEMPTED = "preempted"  # preempted before its share was safely written
    ASLEEP = "asleep"  # vLLM went to sleep (sleep mode) before the reader acknowledged it
    REQUEST_ID = "request_id"  # its request id cannot name a sample (refused at admission)
    OTHER = "other"  # the slot mapping disagreed, its digest failed, the sender stopped


class SampleFailure(NamedTuple):
    reason: FailureReason
    why: str


_REFUSED: dict[str, FailureReason] = {
    "checksum": FailureReason.CHECKSUM,
    "write_failed": FailureReason.WRITE_FAILED,  # another rank's WRITEs failed
    "timeout": FailureReason.TIMEOUT,
    "preempted": FailureReason.PREEMPTED,
}


def refused(code: RefuseCode) -> FailureReason:
    """The reason of a sample its reader refused with ``code``."""
    return _REFUSED.get(code, FailureReason.REFUSED)
