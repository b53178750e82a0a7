"""Fixtures of the integration tests: sender processes that never outlive their test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.integration.common import Senders

if TYPE_CHECKING:
    from tests.integration.pull_common import Producer


@pytest.fixture
def senders() -> Iterator[Senders]:
    """Start sender processes with ``senders.ship`` / ``deliver`` / ``start``; those still
    running when the test ends are killed."""
    s = Senders()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def producers() -> Iterator[list[Producer]]:
    """Pull producer processes (``tests.integration.test_pull.Producer``) a test started:
    each is stopped when the test ends."""
    started: list[Producer] = []
    yield started
    for p in started:
        p.stop()
