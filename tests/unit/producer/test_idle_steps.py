"""``IdleSteps``: the scheduler side's naps before engine steps that schedule nothing, and
the doorbell that ends them."""

from __future__ import annotations

import threading
import time

import pytest

from kv_connector.producer.idle_steps import FIRST_NAP_S, LONGEST_NAP_S, IdleSteps, doorbell


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
