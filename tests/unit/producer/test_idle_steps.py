"""``IdleSteps``: the scheduler side's naps before engine steps that schedule nothing (long
ones while the engine only holds samples), and what ends them: the doorbell, rung in this
process or another, and a request waiting in vLLM's input queue."""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable

import pytest

from kv_connector.producer.engine_bell import Doorbell
from kv_connector.producer.idle_steps import FIRST_NAP_S, LONGEST_NAP_S, IdleSteps, doorbell
from kv_connector.producer.scheduler_side import engine_input_waits


def test_a_step_with_tokens_never_naps() -> None:
    idle = IdleSteps()
    assert [idle.nap(n) for n in (1, 7, 2048)] == [0.0, 0.0, 0.0]


def test_empty_steps_nap_longer_each_time_up_to_the_longest() -> None:
    idle = IdleSteps()
    naps = [idle.nap(0) for _ in range(12)]
    assert naps[0] == FIRST_NAP_S
    assert naps == sorted(naps) and naps[1] == pytest.approx(2 * FIRST_NAP_S)
    assert naps[-1] == LONGEST_NAP_S and max(naps) == LONGEST_NAP_S


def test_work_resets_the_naps() -> None:
    idle = IdleSteps()
    for _ in range(20):
        idle.nap(0)
    assert idle.nap(16) == 0.0
    assert idle.nap(0) == FIRST_NAP_S


def test_a_long_idle_spell_stays_at_the_longest_nap() -> None:
    idle = IdleSteps(first_s=0.5, longest_s=2.0)
    assert [idle.nap(0) for _ in range(3)] == [0.5, 1.0, 2.0]
    assert all(idle.nap(0) == 2.0 for _ in range(10_000))


def test_a_ring_during_a_nap_ends_it_and_the_next_nap_starts_short() -> None:
    idle = IdleSteps(first_s=2.0, longest_s=8.0)
    for _ in range(3):
        idle.nap(0)  # the next nap would be the longest
    threading.Timer(0.05, idle.bell.set).start()
    t0 = time.monotonic()
    assert idle.rest(0) is True
    assert time.monotonic() - t0 < 2.0  # not the 8 s nap
    assert not idle.bell.is_set()
    assert idle.nap(0) == 2.0


def test_a_ring_between_naps_ends_the_next_one_at_once_and_only_that_one() -> None:
    idle = IdleSteps(first_s=60.0, longest_s=60.0)
    idle.bell.set()  # news came while the step ran
    t0 = time.monotonic()
    assert idle.rest(0) is True and time.monotonic() - t0 < 30  # not the 60 s nap
    assert not idle.bell.is_set()
    idle.first_s = idle.longest_s = 0.02
    assert idle.rest(0) is False  # nothing new: a whole nap


def test_a_step_with_tokens_does_not_wait_for_the_bell() -> None:
    idle = IdleSteps(first_s=5.0, longest_s=5.0)
    t0 = time.monotonic()
    assert idle.rest(3) is False and time.monotonic() - t0 < 1.0


def test_each_engine_has_one_bell_in_a_process() -> None:
    assert doorbell("engine-a") is doorbell("engine-a")
    assert doorbell("engine-a") is not doorbell("engine-b")


def test_an_engine_that_only_holds_samples_naps_long_once_the_short_naps_ran_their_course() -> None:
    idle = IdleSteps(first_s=0.001, longest_s=0.004, hold_s=10.0)
    naps = [idle.nap(0, holding_only=True) for _ in range(5)]
    assert naps == [0.001, 0.002, 10.0, 10.0, 10.0]  # the step after a finish comes at once
    assert idle.nap(0, holding_only=False) == 0.004  # a request came in: short again
    assert idle.nap(1, holding_only=True) == 0.0
    assert IdleSteps(hold_s=0.0).nap(0, holding_only=True) == FIRST_NAP_S


def test_a_request_waiting_to_be_added_ends_a_long_nap() -> None:
    idle = IdleSteps(first_s=30.0, longest_s=30.0, hold_s=60.0)
    came = threading.Event()
    threading.Timer(0.1, came.set).start()
    t0 = time.monotonic()
    assert idle.rest(0, holding_only=True, wake=came.is_set) is False  # not rung: woken
    assert time.monotonic() - t0 < 10.0
    idle.first_s = idle.longest_s = 0.02
    assert idle.nap(0) == 0.02  # its steps start the naps short again


def test_a_second_engine_of_the_same_name_cannot_listen_and_its_naps_stay_short() -> None:
    engine = f"engine-{os.getpid()}-{time.monotonic_ns()}"
    first, second = Doorbell(engine), Doorbell(engine)
    try:
        assert first.listen() and not second.listen() and not second.listening
        second.ring()  # heard by the one that listens (an early end of a nap: harmless)
        assert first.is_set() and second.is_set()
    finally:
        first.close()
        second.close()


def test_vllms_input_queue_is_found_on_the_stack_of_the_thread_that_steps() -> None:
    class EngineCore:  # what vLLM's EngineCoreProc has: new requests in input_queue
        def __init__(self) -> None:
            self.input_queue: queue.Queue[object] = queue.Queue()

        def step(self) -> Callable[[], bool] | None:
            return engine_input_waits(sys._getframe(0))

    core = EngineCore()
    waits = core.step()
    assert waits is not None and waits() is False
    core.input_queue.put(("add", "request"))
    assert waits() is True
    assert engine_input_waits(sys._getframe(0)) is None  # no engine above this test
