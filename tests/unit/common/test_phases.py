"""``Phases``: a start's phases timed in order, in wall, CPU and run-queue time, and how a
slow one is named."""

from __future__ import annotations

import pytest

from kv_connector.common.phases import Phase, Phases


class Clocks:
    """Hand-moved clocks: wall, CPU and queued seconds."""

    def __init__(self) -> None:
        self.wall = self.cpu = self.queued = 0.0

    def move(self, wall: float, cpu: float, queued: float) -> None:
        self.wall += wall
        self.cpu += cpu
        self.queued += queued


def phases_of(c: Clocks) -> Phases:
    return Phases(lambda: c.wall, lambda: c.cpu, lambda: c.queued)


def test_each_lap_ends_the_phase_that_began_at_the_last_one() -> None:
    c = Clocks()
    p = phases_of(c)
    c.move(2.0, 1.5, 0.25)
    first = p.lap("imports")
    c.move(60.0, 1.0, 58.0)
    second = p.lap("pool allocation")
    assert first == Phase("imports", 2.0, 1.5, 0.25)
    assert second == Phase("pool allocation", 60.0, 1.0, 58.0)
    assert p.total_s == pytest.approx(62.0)
    assert p.slowest() == second


def test_a_phase_measured_before_the_clocks_ran_comes_first_and_counts() -> None:
    c = Clocks()
    p = phases_of(c)
    p.add("interpreter and imports", 3.0, 1.0, 1.75)
    c.move(1.0, 1.0, 0.0)
    p.lap("UCX")
    assert [x.name for x in p.done] == ["interpreter and imports", "UCX"]
    assert p.total_s == pytest.approx(4.0) and p.slowest() == p.done[0]
    assert p.describe() == (
        "interpreter and imports 3.0 s (CPU 1.0 s, queued 1.8 s), UCX 1.0 s (CPU 1.0 s, queued 0.0 s)"
    )
    assert p.as_dict()["UCX"] == {"wall_s": 1.0, "cpu_s": 1.0, "queued_s": 0.0}


def test_without_a_run_queue_clock_phases_say_only_what_was_counted() -> None:
    c = Clocks()
    p = Phases(lambda: c.wall, lambda: c.cpu)
    c.move(1.0, 0.5, 0.0)
    assert p.lap("serving").queued_s is None
    p.add("before", -0.5)  # a clock step backwards between two hosts' clocks: no negative phase
    assert p.done[-1].wall_s == 0.0 and p.done[-1].cpu_s is None
    assert p.describe() == "serving 1.0 s (CPU 0.5 s), before 0.0 s"


def test_no_phase_has_no_slowest() -> None:
    assert Phases(lambda: 0.0, lambda: 0.0).slowest() is None
