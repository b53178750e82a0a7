"""How long a serving loop waits before it looks again: spin, then sleep.

UCX moves a WRITE's bytes inside the polls of both agents (no progress thread), so while
a WRITE is due a loop must poll tightly; spinning for ever would burn a core. A
``Poller`` answers "how long may I block now": not at all for ``spin`` rounds after the
last event while work is due, then ``busy_s``, and ``idle_s`` when nothing is due.
Pure logic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

IDLE_POLL_S = 0.05


@dataclass
class Poller:
    spin: int = 20
    busy_s: float = 0.0002
    idle_s: float = IDLE_POLL_S
    _idle_rounds: int = 0

    @classmethod
    def from_env(cls, prefix: str) -> Poller:
        """``{prefix}_SPIN_POLLS`` and ``{prefix}_POLL_S`` override the defaults (tuning
        knobs for hosts where the two agents share few cores)."""
        return cls(
            spin=int(os.environ.get(f"{prefix}_SPIN_POLLS", "20")),
            busy_s=float(os.environ.get(f"{prefix}_POLL_S", "0.0002")),
        )

    def timeout(self, due: bool) -> float:
        """Seconds to block in the next select, given whether work is due."""
        if not due:
            return self.idle_s
        return 0.0 if self._idle_rounds < self.spin else self.busy_s

    def after(self, busy: bool) -> None:
        """Record whether the last round did anything."""
        self._idle_rounds = 0 if busy else self._idle_rounds + 1
