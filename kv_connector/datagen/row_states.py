"""The data-generation driver's row machine (``plan.RowBook`` moves the rows): the states of
a row, the events that move it, and the one table of its legal transitions
(``common/transitions.py``). A row moves only through ``ROWS.step``; a pair not in the
table raises ``IllegalRowTransition``. Pure.

    QUEUED     -- taken ------------> SENT        its request is in flight
    SENT       -- delivered --------> DELIVERED   the answer said delivered
    SENT       -- pending ----------> AWAITING    with a directory to confirm in
    SENT       -- unconfirmed ------> DELIVERED   "pending" with nowhere to confirm: counted
    AWAITING   -- file_seen --------> DELIVERED
    SENT       -- failed -----------> QUEUED      again after a backoff
    AWAITING   -- no_file ----------> QUEUED      its file did not appear in time
    SENT/AWAITING -- given_up ------> GAVE_UP     after ``max_attempts``, or refused for good
    DELIVERED  -- audit_failed -----> GAVE_UP     its states failed the logprob audit

Rows begin QUEUED. GAVE_UP is terminal; DELIVERED is, but for the audit.
"""

from __future__ import annotations

import enum

from kv_connector.common.errors import StateError
from kv_connector.common.transitions import Transitions


class IllegalRowTransition(StateError):
    """The driver reported something a row's state does not allow."""


class RowState(enum.Enum):
    QUEUED = "queued"
    SENT = "sent"
    # the response said pending; its file is not there yet
    AWAITING = "awaiting"
    DELIVERED = "delivered"
    GAVE_UP = "gave_up"


class RowEvent(enum.Enum):
    TAKEN = "taken"
    DELIVERED = "delivered"
    PENDING = "pending"
    UNCONFIRMED = "unconfirmed"
    FILE_SEEN = "file_seen"
    FAILED = "failed"
    NO_FILE = "no_file"
    GIVEN_UP = "given_up"
    AUDIT_FAILED = "audit_failed"


_S, _E = RowState, RowEvent

ROWS: Transitions[RowState, RowEvent] = Transitions(
    {
        (_S.QUEUED, _E.TAKEN): _S.SENT,
        (_S.SENT, _E.DELIVERED): _S.DELIVERED,
        (_S.SENT, _E.PENDING): _S.AWAITING,
        (_S.SENT, _E.UNCONFIRMED): _S.DELIVERED,
        (_S.AWAITING, _E.FILE_SEEN): _S.DELIVERED,
        (_S.SENT, _E.FAILED): _S.QUEUED,
        (_S.AWAITING, _E.NO_FILE): _S.QUEUED,
        (_S.SENT, _E.GIVEN_UP): _S.GAVE_UP,
        (_S.AWAITING, _E.GIVEN_UP): _S.GAVE_UP,
        (_S.DELIVERED, _E.AUDIT_FAILED): _S.GAVE_UP,
    },
    IllegalRowTransition,
)
