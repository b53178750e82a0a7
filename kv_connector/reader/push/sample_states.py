"""The reader's sample machine (``ledger.py`` decides when, ``records.py`` and
``book.py`` keep the samples): the states of a sample, the events that move it, the ends
by which it leaves the books, the one table of its legal transitions, and the movers. A
sample moves only through ``begin``, ``move`` (it stays in the books) or ``leave`` (it
leaves them), each checked against the table; a transition not in the table raises
``IllegalSampleTransition``. Pure.

States of a sample (``SampleState``), keyed by (producer id, request id), and its ends
(``SampleEnd``):

    (none)     -- requested ------> PROMISED    its first credit request: it waits in the
                                                pool's FIFO for a run of pages
    PROMISED   -- granted --------> GRANTED     pages free: every rank's peer gets the Grant
    GRANTED    -- landed ---------> WRITTEN     every rank registered, every WRITE landed
    GRANTED/WRITTEN -- checked ---> CHECKED    the last share checked: queued for the user
                                                (from GRANTED when nothing was left to check)
    GRANTED/WRITTEN -- check_failed -> GRANTED  that rank writes its share again (Rewrite)
    CHECKED   -- handed_out -----> HANDED_OUT  on lease to the user: a view of its pages
    HANDED_OUT -- released -------> released    the lease ended: its pages return to the pool
    GRANTED/WRITTEN/CHECKED -- refused -> refused    a share failed too often, came without
                                                the checksum required, or the sample was
                                                not complete by its deadline; or the
                                                consumer rejected it (CHECKED): its
                                                producer is told, its pages quarantined
    PROMISED/GRANTED/WRITTEN -- discarded -> discarded  its producer is gone or gave up:
                                                its pages quarantined

The ends have no way out: a sample that left the books is gone (a resend of a delivered
one is acked from ``delivered.py``, never a new record). A reject of a sample handed out
and not acked yet (manual mode) refuses its producer without moving the sample: its
pages return on release.
"""

from __future__ import annotations

import enum
from typing import Protocol

from kv_connector.common.errors import StateError
from kv_connector.common.transitions import Transitions


class IllegalSampleTransition(StateError):
    """A shell asked for a transition the sample's state does not allow."""


class SampleState(enum.Enum):
    PROMISED = "promised"
    GRANTED = "granted"
    WRITTEN = "written"
    CHECKED = "checked"
    HANDED_OUT = "handed_out"


class SampleEnd(enum.Enum):
    """How a sample left the books."""

    RELEASED = "released"
    REFUSED = "refused"
    DISCARDED = "discarded"


class SampleEvent(enum.Enum):
    REQUESTED = "requested"
    GRANTED = "granted"
    LANDED = "landed"
    CHECKED = "checked"
    CHECK_FAILED = "check_failed"
    HANDED_OUT = "handed_out"
    RELEASED = "released"
    REFUSED = "refused"
    DISCARDED = "discarded"


_S, _E, _END = SampleState, SampleEvent, SampleEnd

SAMPLES: Transitions[SampleState | SampleEnd, SampleEvent] = Transitions(
    {
        (None, _E.REQUESTED): _S.PROMISED,
        (_S.PROMISED, _E.GRANTED): _S.GRANTED,
        (_S.GRANTED, _E.LANDED): _S.WRITTEN,
        (_S.GRANTED, _E.CHECKED): _S.CHECKED,
        (_S.WRITTEN, _E.CHECKED): _S.CHECKED,
        (_S.GRANTED, _E.CHECK_FAILED): _S.GRANTED,
        (_S.WRITTEN, _E.CHECK_FAILED): _S.GRANTED,
        (_S.CHECKED, _E.HANDED_OUT): _S.HANDED_OUT,
        (_S.HANDED_OUT, _E.RELEASED): _END.RELEASED,
        (_S.GRANTED, _E.REFUSED): _END.REFUSED,
        (_S.WRITTEN, _E.REFUSED): _END.REFUSED,
        (_S.CHECKED, _E.REFUSED): _END.REFUSED,
        (_S.PROMISED, _E.DISCARDED): _END.DISCARDED,
        (_S.GRANTED, _E.DISCARDED): _END.DISCARDED,
        (_S.WRITTEN, _E.DISCARDED): _END.DISCARDED,
    },
    IllegalSampleTransition,
)


def step(state: SampleState | None, event: SampleEvent, what: str = "") -> SampleState:
    """The state ``event`` moves a sample (``what``) in ``state`` to; it stays in the books."""
    return SAMPLES.step_as(SampleState, state, event, what, "ends the sample")


def end(state: SampleState, event: SampleEvent, what: str = "") -> SampleEnd:
    """How ``event`` ends a sample (``what``) in ``state``: it leaves the books."""
    return SAMPLES.step_as(SampleEnd, state, event, what, "does not end the sample")


class Moving(Protocol):
    """A sample as the movers see it: its key (producer id, request id) and its state."""

    key: tuple[str, str]
    state: SampleState


def _name(sample: Moving) -> str:
    return f"sample {sample.key[1]} of {sample.key[0]}"


# The movers: every change of a sample's state goes through one of these three, here beside
# the table (the ledger decides which event happens; its records and book call these).
def begin(sample: Moving) -> None:
    """A new sample enters the books: PROMISED (``requested``)."""
    sample.state = step(None, SampleEvent.REQUESTED, _name(sample))


def move(sample: Moving, event: SampleEvent) -> None:
    """To the state ``event`` leads to, or ``IllegalSampleTransition`` with nothing changed."""
    sample.state = step(sample.state, event, _name(sample))


def leave(sample: Moving, event: SampleEvent) -> SampleEnd:
    """How ``event`` ends the sample, or ``IllegalSampleTransition``; the book then removes
    it (its state stays the last it had, for what follows its end)."""
    return end(sample.state, event, _name(sample))
