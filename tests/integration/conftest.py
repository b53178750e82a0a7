"""Fixtures of the integration tests: sender processes that never outlive their test, and
pull producer processes, a test's own or shared by a module's tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.engines import FAILED
from tests.integration.common import Senders
from tests.integration.pull_common import SharedProducers

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


@pytest.fixture(scope="module")
def _shared_pull_producers() -> Iterator[SharedProducers]:
    shared = SharedProducers()
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def pulls(
    _shared_pull_producers: SharedProducers, request: pytest.FixtureRequest
) -> Iterator[SharedProducers]:
    """Pull producer processes shared by the module's tests, by configuration
    (``pulls.lend(spec)``): reset after the test, stopped if it failed."""
    yield _shared_pull_producers
    _shared_pull_producers.give_back(failed=request.node.stash.get(FAILED, False))
