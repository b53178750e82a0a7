"""Naps between the engine steps that schedule nothing.

vLLM steps its engine without pause while any finished request still holds its blocks
(``Scheduler.has_requests`` counts them), so a producer holding pulled samples for a
consumer that has not asked yet, with no request running, turns every core its engine
and workers have into empty steps: on a small host that starves the consumer itself (a
2-core machine took 20 s to open a ``PullClient`` beside an idle TP=2 server holding five
samples). ``IdleSteps`` answers how long the scheduler side naps before such a step: 1 ms
after the first, doubling to 25 ms; nothing once a step schedules tokens. A new request
waits at most that long; a released sample's blocks go back to vLLM at most that late.
Pure logic.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_NAP_S = 0.001
LONGEST_NAP_S = 0.025


@dataclass
class IdleSteps:
    first_s: float = FIRST_NAP_S
    longest_s: float = LONGEST_NAP_S
    _idle: int = 0  # steps in a row that scheduled nothing

    def nap(self, scheduled_tokens: int) -> float:
        """Seconds to nap before a step that schedules ``scheduled_tokens`` tokens."""
        if scheduled_tokens > 0:
            self._idle = 0
            return 0.0
        self._idle += 1
        return min(self.longest_s, self.first_s * 2.0 ** min(self._idle - 1, 32))
