"""The reader's table of sample transitions (``reader.push.sample_states``) is the machine the
ledger enforces: every state and end reachable, the ends with no way out, an illegal
transition raising ``IllegalSampleTransition``, and the ledger, its records and its book
moving a sample only through the table."""

from __future__ import annotations

import pytest

from kv_connector.reader.push import sample_states
from kv_connector.reader.push.sample_states import (
    SAMPLES,
    IllegalSampleTransition,
    SampleEnd,
    SampleEvent,
    SampleState,
    end,
    step,
)
from tests.unit.reader.push.helpers import checked_sample, ledger, written


def test_every_state_and_end_is_reachable_and_only_the_ends_are_terminal() -> None:
    assert SAMPLES.reachable() == set(SampleState) | set(SampleEnd)
    assert SAMPLES.terminal() == set(SampleEnd)
    for e in SampleEnd:
        assert SAMPLES.exits(e) == {}
    assert SAMPLES.exits(None) == {SampleEvent.REQUESTED: SampleState.PROMISED}


def test_a_sample_on_lease_can_only_be_released() -> None:
    assert SAMPLES.exits(SampleState.HANDED_OUT) == {SampleEvent.RELEASED: SampleEnd.RELEASED}


def test_an_illegal_transition_raises_and_names_it() -> None:
    with pytest.raises(IllegalSampleTransition, match="sample a of p: handed_out is not allowed in state"):
        step(SampleState.WRITTEN, SampleEvent.HANDED_OUT, "sample a of p")
    with pytest.raises(IllegalSampleTransition, match="discarded is not allowed in state handed_out"):
        end(SampleState.HANDED_OUT, SampleEvent.DISCARDED)
    with pytest.raises(IllegalSampleTransition, match="ends the sample"):
        step(SampleState.HANDED_OUT, SampleEvent.RELEASED)  # an end, not a state
    with pytest.raises(IllegalSampleTransition, match="does not end the sample"):
        end(SampleState.CHECKED, SampleEvent.HANDED_OUT)
    for e in SampleEnd:
        for event in SampleEvent:
            assert not SAMPLES.allows(e, event)  # type: ignore[arg-type]


def test_the_ledger_hands_out_only_through_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take CHECKED -> HANDED_OUT out of the table: the hand-out raises and the sample
    stays CHECKED, ready (nothing moved before the table said yes)."""
    rules = {k: v for k, v in SAMPLES.rules.items() if k != (SampleState.CHECKED, SampleEvent.HANDED_OUT)}
    monkeypatch.setattr(sample_states.SAMPLES, "rules", rules)
    led = ledger()
    key = checked_sample(led)
    with pytest.raises(IllegalSampleTransition, match="handed_out is not allowed in state checked"):
        led.hand_out(key, 1.0)
    assert led.view.state_of(key) is SampleState.CHECKED and led.view.ready() == [key]


def test_the_book_drops_only_through_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take WRITTEN -> refused out of the table: a sample past its deadline cannot be
    refused, and stays in the books."""
    rules = {k: v for k, v in SAMPLES.rules.items() if k != (SampleState.WRITTEN, SampleEvent.REFUSED)}
    monkeypatch.setattr(sample_states.SAMPLES, "rules", rules)
    led = ledger(sample_timeout_s=1.0)
    key = written(led)
    with pytest.raises(IllegalSampleTransition, match="refused is not allowed in state written"):
        led.tick(10.0)
    assert led.view.state_of(key) is SampleState.WRITTEN


def test_every_move_of_a_sample_is_made_beside_the_table() -> None:
    """The movers live in ``sample_states``: no other module of the push reader assigns a
    sample's state or steps the table itself."""
    import inspect
    import re

    from kv_connector.reader.push import book, ledger, records, refusals

    for module in (book, ledger, records, refusals):
        source = inspect.getsource(module)
        assert not re.search(r"\.state\s*=[^=]", source), module.__name__
        assert not re.search(r"\b(step|end)\(", source), module.__name__
        assert "SAMPLES." not in source, module.__name__
