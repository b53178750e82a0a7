"""Naps between the engine steps that schedule nothing, cut short by the engine's news.

vLLM steps its engine without pause while any finished request still holds its blocks
(``Scheduler.has_requests`` counts them), so a producer holding pulled samples for a
consumer that has not asked yet, with no request running, turns every core its engine
and workers have into empty steps: on a small host that starves the consumer itself (a
2-core machine took 20 s to open a ``PullClient`` beside an idle TP=2 server holding five
samples). ``IdleSteps`` answers how long the scheduler side naps before such a step: 1 ms
after the first, doubling to 25 ms; nothing once a step schedules tokens.

A nap ends early when the engine's ``doorbell`` rings: the worker side rings it when a
step would have news for the scheduler (a reader acknowledged or refused a sample, a
consumer released one: its blocks go back to vLLM in the next step). Without it, a
producer whose cache is full of samples waiting for their readers napped up to 25 ms
after a reader's ack before vLLM freed those blocks and admitted the next request (the
data-path bench saw its writer idle for want of granted samples). Both sides of one
engine share a process when its workers do (TP=1: the in-process engine core and
vLLM's uniprocess executor); across processes nothing rings and a nap runs its length.
Pure logic.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

FIRST_NAP_S = 0.001
LONGEST_NAP_S = 0.025

_bells: dict[str, threading.Event] = {}
_bells_lock = threading.Lock()


def doorbell(engine: str) -> threading.Event:
    """The bell of the engine named ``engine`` in this process (one per name, made on
    first use): the worker side ``set``s it, the scheduler side's naps wait on it."""
    with _bells_lock:
        bell = _bells.get(engine)
        if bell is None:
            bell = _bells[engine] = threading.Event()
        return bell


@dataclass
class IdleSteps:
    first_s: float = FIRST_NAP_S
    longest_s: float = LONGEST_NAP_S
    bell: threading.Event = field(default_factory=threading.Event)
    _idle: int = 0  # steps in a row that scheduled nothing

    def nap(self, scheduled_tokens: int) -> float:
        """Seconds to nap before a step that schedules ``scheduled_tokens`` tokens."""
        if scheduled_tokens > 0:
            self._idle = 0
            return 0.0
        self._idle += 1
        return min(self.longest_s, self.first_s * 2.0 ** min(self._idle - 1, 32))

    def rest(self, scheduled_tokens: int) -> bool:
        """Nap before a step (``nap``) unless or until the bell rings; True if it rang
        (then the next nap starts short again). A ring while no nap was under way ends
        the next one at once: its news is reported by the step after it."""
        seconds = self.nap(scheduled_tokens)
        if not seconds:
            return False
        rang = self.bell.wait(seconds)
        if rang:
            self.bell.clear()
            self._idle = 0
        return rang
