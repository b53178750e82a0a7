"""Naps between the engine steps that schedule nothing, cut short by the engine's news.

vLLM steps its engine without pause while a finished request still holds its blocks
(``Scheduler.has_requests`` counts them). A producer holding pulled samples with no request
running would turn every core of its engine and workers into empty steps, starving a
consumer on the same small host. ``IdleSteps`` says how long the scheduler side naps before
such a step: 1 ms after the first, doubling to 25 ms, and nothing once a step schedules tokens.

Even 25 ms is too often for vLLM's multiprocess executor. Each step is a message to the
workers, and a worker's queue busy-waits (``sched_yield``) for 1 s after every message.
So once the engine holds samples and no request at all (``holding_only``), a nap lasts
``hold_s`` and the workers go idle (docs/design.md). Nothing is late for it: a new request
ends the nap (``wake``), and so does a consumer's release. Only the expiry of a sample
nobody released is noticed up to ``hold_s`` late.

A nap also ends when the engine's doorbell (``engine_bell``) rings. The worker side rings it
when a step would have news for the scheduler: a reader acknowledged or refused a sample, or
a consumer released one. Its blocks then go back to vLLM in the next step, not a nap later.
The policy here is pure; the waiting is the bell's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kv_connector.producer.engine_bell import Doorbell, doorbell

FIRST_NAP_S = 0.001
LONGEST_NAP_S = 0.025
# a nap while the engine only holds samples (its workers then sleep)
HOLD_NAP_S = 10.0


@dataclass
class IdleSteps:
    first_s: float = FIRST_NAP_S
    longest_s: float = LONGEST_NAP_S
    hold_s: float = HOLD_NAP_S
    bell: Doorbell = field(default_factory=lambda: Doorbell("idle-steps"))
    # steps in a row that scheduled nothing
    _idle: int = 0

    def nap(self, scheduled_tokens: int, holding_only: bool = False) -> float:
        """Seconds to nap before a step that schedules ``scheduled_tokens`` tokens;
        ``holding_only``: the engine has no request but the finished ones it holds."""
        if scheduled_tokens > 0:
            self._idle = 0
            return 0.0
        self._idle += 1
        short = min(self.longest_s, self.first_s * 2.0 ** min(self._idle - 1, 32))
        if holding_only and short >= self.longest_s:
            return max(self.hold_s, short)
        return short

    def rest(
        self, scheduled_tokens: int, holding_only: bool = False, wake: Callable[[], bool] | None = None
    ) -> bool:
        """Nap before a step unless or until the bell rings or ``wake()`` says a request waits.

        True if the bell rang; the next nap then starts short again. A ring while no nap was under
        way ends the next one at once, and the step after it reports the news.
        """
        seconds = self.nap(scheduled_tokens, holding_only)
        if not seconds:
            return False
        rang = self.bell.wait(seconds, wake)
        if rang:
            self.bell.clear()
            self._idle = 0
        elif wake is not None and wake():
            # a request came: the naps after its steps start short
            self._idle = 0
        return rang


__all__ = ["FIRST_NAP_S", "HOLD_NAP_S", "LONGEST_NAP_S", "IdleSteps", "doorbell"]
