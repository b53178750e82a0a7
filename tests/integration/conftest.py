"""Fixtures of the integration tests: sender processes that never outlive their test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.common import Senders


@pytest.fixture
def senders() -> Iterator[Senders]:
    """Start sender processes with ``senders.ship`` / ``deliver`` / ``start``; those still
    running when the test ends are killed."""
    s = Senders()
    try:
        yield s
    finally:
        s.close()
