"""``IdleSteps``: the scheduler side's naps before engine steps that schedule nothing."""

from __future__ import annotations

import pytest

from kv_connector.producer.idle_steps import FIRST_NAP_S, LONGEST_NAP_S, IdleSteps


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
