"""A start's phases, timed in order, so a slow start says which phase was slow and why.

Each phase has the wall time it took, the CPU time the process spent in it, and the time
it waited, runnable, for a core (Linux's run-queue delay). A slow phase worked (CPU), was
starved (queued: other processes had the cores), or was blocked (neither). Pure: the
clocks are passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Phase:
    """One phase: ``wall_s`` seconds passed, ``cpu_s`` of them spent on a core by the process.

    ``queued_s`` of them were spent runnable but waiting for a core (None where it was not
    counted)."""

    name: str
    wall_s: float
    cpu_s: float | None
    queued_s: float | None = None


@dataclass
class Phases:
    """Phases lapped one after the other: ``lap(name)`` ends the phase that began at the
    last lap (or at construction)."""

    wall: Callable[[], float]
    cpu: Callable[[], float]
    queued: Callable[[], float | None] = lambda: None
    done: list[Phase] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._wall0, self._cpu0, self._queued0 = self.wall(), self.cpu(), self.queued()

    def add(
        self, name: str, wall_s: float, cpu_s: float | None = None, queued_s: float | None = None
    ) -> None:
        """A phase measured elsewhere (before this object counted)."""
        self.done.append(Phase(name, max(0.0, wall_s), cpu_s, queued_s))

    def lap(self, name: str) -> Phase:
        wall, cpu, queued = self.wall(), self.cpu(), self.queued()
        waited = None if queued is None or self._queued0 is None else queued - self._queued0
        phase = Phase(name, wall - self._wall0, cpu - self._cpu0, waited)
        self._wall0, self._cpu0, self._queued0 = wall, cpu, queued
        self.done.append(phase)
        return phase

    @property
    def total_s(self) -> float:
        return sum(p.wall_s for p in self.done)

    def slowest(self) -> Phase | None:
        return max(self.done, key=lambda p: p.wall_s, default=None)

    def describe(self) -> str:
        """``name 1.2 s (CPU 1.1 s, queued 0.1 s), ...``: every phase, in order."""
        parts = []
        for p in self.done:
            counted = (("CPU", p.cpu_s), ("queued", p.queued_s))
            told = [f"{what} {v:.1f} s" for what, v in counted if v is not None]
            parts.append(f"{p.name} {p.wall_s:.1f} s" + (f" ({', '.join(told)})" if told else ""))
        return ", ".join(parts)

    def as_dict(self) -> dict[str, dict[str, float | None]]:
        """{name: {"wall_s", "cpu_s", "queued_s"}} in order (JSON-ready)."""
        return {p.name: {"wall_s": _r(p.wall_s), "cpu_s": _r(p.cpu_s), "queued_s": _r(p.queued_s)}
                for p in self.done}


def _r(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


__all__ = ["Phase", "Phases"]
