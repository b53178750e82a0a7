"""A state machine's legal transitions as one table: (state, event) -> the state it leads to.

Every pair not in the table is illegal. The ledgers' machines each keep theirs next to
their states: the reader's samples (``reader.push.sample_states``), the sender's jobs
(``sender.job_states``), the pull ledger's holds (``producer.pull.hold_states``), the
data-generation driver's rows (``datagen.row_states``). Their
ledgers move a record only through ``Transitions.step``, so the table is what is
enforced. ``None`` stands for "no record yet": the pairs from it are how a record begins.
A state with no pair out of it is terminal. Pure: no project imports."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

# every state the table names, terminal ones included
S = TypeVar("S", bound=enum.Enum)
# the events
E = TypeVar("E", bound=enum.Enum)
# one kind of state (``step_as``)
K = TypeVar("K", bound=enum.Enum)


class Transitions(Generic[S, E]):
    """``rules``: (state or None, event) -> the next state.

    An illegal pair raises what ``illegal`` makes of its message: the machine's own error."""

    def __init__(self, rules: Mapping[tuple[S | None, E], S], illegal: Callable[[str], Exception]) -> None:
        self.rules: Mapping[tuple[S | None, E], S] = rules
        self._illegal = illegal

    def step(self, state: S | None, event: E, what: str = "") -> S:
        """The state ``event`` leads ``state`` to.

        When the table has no such transition, the machine's error names ``what`` (the
        record), the event and the state."""
        to = self.rules.get((state, event))
        if to is None:
            where = "no record" if state is None else f"state {state.value}"
            raise self._illegal(f"{what + ': ' if what else ''}{event.value} is not allowed in {where}")
        return to

    def step_as(self, kind: type[K], state: S | None, event: E, what: str, otherwise: str) -> K:
        """``step``, for a machine whose states are two enums: the live ones and the ends.

        Returns the state it leads to, checked to be a ``kind``. When it is of the other
        kind, the machine's error says ``what`` ``otherwise``."""
        to = self.step(state, event, what)
        if not isinstance(to, kind):
            raise self._illegal(f"{what}: {event.value} {otherwise} ({to.value})")
        return to

    def allows(self, state: S | None, event: E) -> bool:
        return (state, event) in self.rules

    def exits(self, state: S | None) -> dict[E, S]:
        """The events ``state`` has a transition for, and where each leads."""
        return {e: to for (s, e), to in self.rules.items() if s == state}

    def reachable(self) -> set[S]:
        """Every state some run of events leads to from no record."""
        seen: set[S] = set()
        todo: list[S | None] = [None]
        while todo:
            for to in self.exits(todo.pop()).values():
                if to not in seen:
                    seen.add(to)
                    todo.append(to)
        return seen

    def terminal(self) -> set[S]:
        """The states the table leads to and that have no way out."""
        return {to for to in self.rules.values() if not self.exits(to)}
