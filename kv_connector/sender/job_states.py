"""The sender's job machine (``ledger.py`` decides when; the job is ``jobs.py``'s):
its states, the events that move a job, the ends by which it leaves the ledger, and
the one table of its legal transitions. A job moves only through ``step`` (it stays in
the ledger) or ``end`` (it leaves it, reported once); a transition not in the table
raises ``IllegalJobTransition``. Pure.

States of a job (``JobState``), on the current connection to the reader, and its ends
(``JobEnd``):

    (none)    -- submitted -------> WAITING     a held job waits here too (its step may
                                                still run on the device): neither
                                                requested nor hashed before ``hold(False)``
    WAITING   -- request_sent ----> REQUESTED   credit request sent
    REQUESTED -- granted ---------> GRANTED     pages granted; WRITE due
    WAITING   -- placed ----------> GRANTED     a new job placed in a credit held ahead
                                                (``Placed`` sent, no round trip); WRITE due
    GRANTED   -- write_posted ----> WRITING     at most one WRITE in flight; its checksum
                                                rides with it, or follows
    GRANTED   -- nothing_to_write > WRITTEN     this rank has no block of it
    WRITING   -- write_completed -> WRITTEN
    WRITING   -- write_failed ----> GRANTED     posted again after a backoff
    WRITING   -- rewrite ---------> GRANTED     a Rewrite that came while the WRITE was in
                                                flight, applied when it completes
    WRITTEN   -- rewrite ---------> GRANTED     the reader's checksum failed
    any       -- acked -----------> finished    the reader has the sample (WRITING: applied
                                                once the WRITE completes); reported once by
                                                ``take_finished``
    any       -- connection_lost -> WAITING     resent after reconnecting
    any       -- failed ----------> failed      reported once by ``take_failed``

A Rewrite of a GRANTED job moves nothing (its WRITE is due anyway).
"""

from __future__ import annotations

import enum

from kv_connector.common.errors import StateError
from kv_connector.common.transitions import Transitions


class IllegalJobTransition(StateError):
    """The shell asked for a transition the job's state does not allow."""


class JobState(enum.Enum):
    WAITING = "waiting"
    REQUESTED = "requested"
    GRANTED = "granted"
    WRITING = "writing"
    WRITTEN = "written"


class JobEnd(enum.Enum):
    """How a job left the ledger."""

    FINISHED = "finished"
    FAILED = "failed"


class JobEvent(enum.Enum):
    SUBMITTED = "submitted"
    REQUEST_SENT = "request_sent"
    GRANTED = "granted"
    PLACED = "placed"
    NOTHING_TO_WRITE = "nothing_to_write"
    WRITE_POSTED = "write_posted"
    WRITE_COMPLETED = "write_completed"
    WRITE_FAILED = "write_failed"
    REWRITE = "rewrite"
    ACKED = "acked"
    CONNECTION_LOST = "connection_lost"
    FAILED = "failed"


_S, _E = JobState, JobEvent

JOBS: Transitions[JobState | JobEnd, JobEvent] = Transitions(
    {
        (None, _E.SUBMITTED): _S.WAITING,
        (_S.WAITING, _E.REQUEST_SENT): _S.REQUESTED,
        (_S.REQUESTED, _E.GRANTED): _S.GRANTED,
        (_S.WAITING, _E.PLACED): _S.GRANTED,
        (_S.GRANTED, _E.WRITE_POSTED): _S.WRITING,
        (_S.GRANTED, _E.NOTHING_TO_WRITE): _S.WRITTEN,
        (_S.WRITING, _E.WRITE_COMPLETED): _S.WRITTEN,
        (_S.WRITING, _E.WRITE_FAILED): _S.GRANTED,
        (_S.WRITING, _E.REWRITE): _S.GRANTED,
        (_S.WRITTEN, _E.REWRITE): _S.GRANTED,
        **{(s, _E.ACKED): JobEnd.FINISHED for s in JobState},
        **{(s, _E.CONNECTION_LOST): _S.WAITING for s in JobState},
        **{(s, _E.FAILED): JobEnd.FAILED for s in JobState},
    },
    IllegalJobTransition,
)


def step(state: JobState | None, event: JobEvent, what: str = "") -> JobState:
    """The state ``event`` moves a job (``what``) in ``state`` to; it stays in the ledger."""
    return JOBS.step_as(JobState, state, event, what, "ends the job")


def end(state: JobState, event: JobEvent, what: str = "") -> JobEnd:
    """How ``event`` ends a job (``what``) in ``state``: it leaves the ledger."""
    return JOBS.step_as(JobEnd, state, event, what, "does not end the job")
