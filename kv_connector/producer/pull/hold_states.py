"""The pull ledger's state machine (``ledger.py``): the states of a sample one rank
holds for consumers to READ, the events that move it, and the one table of its legal
transitions, which the ledger moves every sample through (``HOLDS.step``). Pure.

    (none) -- hold -----> HELD       (the step computed it; its handle goes out)
    (none) -- fail -----> FAILED     (its blocks could not be found: never held)
    HELD   -- release --> RELEASED   (the consumer read it and let it go)
    HELD   -- expire ---> EXPIRED    (not released within ``pull_timeout_s`` of its
                                      request's finish)
    HELD   -- preempt --> PREEMPTED  (vLLM reuses its blocks for another request)
    HELD   -- abort ----> ABORTED    (its request was aborted; nobody got its handle)
    HELD   -- close ----> CLOSED     (the engine shuts down)
    HELD   -- fail -----> FAILED     (the shell could not keep it)

Every state but HELD is terminal: the ledger remembers (boundedly) how a sample ended,
to answer a late fetch or release with why. A request held again after its sample ended
is a new sample (no record: the old ending is forgotten); holding one held already is
illegal (P6).
"""

from __future__ import annotations

import enum

from kv_connector.common.errors import StateError
from kv_connector.common.transitions import Transitions


class IllegalTransition(StateError):
    """The shell asked for a transition the sample's state does not allow."""


class HoldState(enum.Enum):
    HELD = "held"
    RELEASED = "released"
    EXPIRED = "expired"
    PREEMPTED = "preempted"
    ABORTED = "aborted"
    CLOSED = "closed"
    FAILED = "failed"


class HoldEvent(enum.Enum):
    HOLD = "hold"
    RELEASE = "release"
    EXPIRE = "expire"
    PREEMPT = "preempt"
    ABORT = "abort"
    CLOSE = "close"
    FAIL = "fail"


HOLDS: Transitions[HoldState, HoldEvent] = Transitions(
    {
        (None, HoldEvent.HOLD): HoldState.HELD,
        (None, HoldEvent.FAIL): HoldState.FAILED,
        (HoldState.HELD, HoldEvent.RELEASE): HoldState.RELEASED,
        (HoldState.HELD, HoldEvent.EXPIRE): HoldState.EXPIRED,
        (HoldState.HELD, HoldEvent.PREEMPT): HoldState.PREEMPTED,
        (HoldState.HELD, HoldEvent.ABORT): HoldState.ABORTED,
        (HoldState.HELD, HoldEvent.CLOSE): HoldState.CLOSED,
        (HoldState.HELD, HoldEvent.FAIL): HoldState.FAILED,
    },
    IllegalTransition,
)
