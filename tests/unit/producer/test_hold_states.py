"""The pull ledger's table of transitions (``producer.pull.hold_states``) is the machine the
ledger enforces: every state reachable, HELD the only one with a way out, an illegal
transition raising ``IllegalTransition``, and the ledger moving only through it."""

from __future__ import annotations

import pytest

from kv_connector.producer.pull.hold_states import HOLDS, HoldEvent, HoldState, IllegalTransition
from kv_connector.producer.pull.ledger import PullLedger
from tests.unit.producer.helpers import held


def test_every_state_is_reachable_and_only_held_has_a_way_out() -> None:
    assert HOLDS.reachable() == set(HoldState)
    assert HOLDS.terminal() == set(HoldState) - {HoldState.HELD}
    for state in HOLDS.terminal():
        assert HOLDS.exits(state) == {}
    assert HOLDS.exits(None) == {HoldEvent.HOLD: HoldState.HELD, HoldEvent.FAIL: HoldState.FAILED}


def test_an_illegal_transition_raises_and_names_it() -> None:
    with pytest.raises(IllegalTransition, match="request r1: hold is not allowed in state held"):
        HOLDS.step(HoldState.HELD, HoldEvent.HOLD, "request r1")
    for state in HOLDS.terminal():
        for event in HoldEvent:
            with pytest.raises(IllegalTransition):
                HOLDS.step(state, event)


def test_the_ledger_moves_only_through_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take one transition out of the table: the ledger refuses it, and the sample stays
    held (nothing moved before the table said yes)."""
    rules = {k: v for k, v in HOLDS.rules.items() if k != (HoldState.HELD, HoldEvent.RELEASE)}
    monkeypatch.setattr(HOLDS, "rules", rules)
    led = PullLedger(timeout_s=10)
    held(led, "r1")
    with pytest.raises(IllegalTransition, match="release is not allowed in state held"):
        led.release("r1", "a" * 32, 1.0)
    assert led.is_held("r1") and led.take_freed() == set()
    assert led.preempt(["r1"]) == ["r1"] and led.take_freed() == {"r1"}
