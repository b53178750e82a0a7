"""The table of a state machine's transitions (``common.transitions``): what it allows,
what it refuses and names, what it reaches and what ends it."""

from __future__ import annotations

import enum

import pytest

from kv_connector.common.transitions import Transitions


class Light(enum.Enum):
    OFF = "off"
    ON = "on"
    BROKEN = "broken"


class Flip(enum.Enum):
    INSTALL = "install"
    SWITCH = "switch"
    SMASH = "smash"


class Wrong(RuntimeError):
    pass


LIGHTS: Transitions[Light, Flip] = Transitions(
    {
        (None, Flip.INSTALL): Light.OFF,
        (Light.OFF, Flip.SWITCH): Light.ON,
        (Light.ON, Flip.SWITCH): Light.OFF,
        (Light.ON, Flip.SMASH): Light.BROKEN,
    },
    Wrong,
)


def test_a_pair_in_the_table_leads_where_it_says() -> None:
    assert LIGHTS.step(None, Flip.INSTALL) is Light.OFF
    assert LIGHTS.step(Light.OFF, Flip.SWITCH) is Light.ON
    assert LIGHTS.allows(Light.ON, Flip.SMASH) and not LIGHTS.allows(Light.OFF, Flip.SMASH)


def test_a_pair_not_in_the_table_raises_the_machines_error_naming_record_event_and_state() -> None:
    with pytest.raises(Wrong, match="lamp 3: smash is not allowed in state off"):
        LIGHTS.step(Light.OFF, Flip.SMASH, "lamp 3")
    with pytest.raises(Wrong, match="switch is not allowed in no record"):
        LIGHTS.step(None, Flip.SWITCH)


def test_reachable_exits_and_terminal() -> None:
    assert LIGHTS.reachable() == set(Light)
    assert LIGHTS.exits(Light.ON) == {Flip.SWITCH: Light.OFF, Flip.SMASH: Light.BROKEN}
    assert LIGHTS.terminal() == {Light.BROKEN}
