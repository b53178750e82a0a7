"""The engine's doorbell between real processes: a worker's process rings, the scheduler
side's nap (``IdleSteps``) in another process ends at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kv_connector.producer.engine_bell import doorbell
from kv_connector.producer.idle_steps import IdleSteps
from tests.integration.common import REPO, child_env

pytestmark = pytest.mark.integration

RING = """
import sys
from kv_connector.producer.engine_bell import doorbell
doorbell(sys.argv[1]).ring()
"""


def test_a_ring_from_another_process_ends_the_nap() -> None:
    engine = f"engine-{os.getpid()}-{time.monotonic_ns()}"
    bell = doorbell(engine)
    assert bell.listen() and bell.listening
    try:
        idle = IdleSteps(first_s=30.0, longest_s=30.0, bell=bell)
        ringer = subprocess.Popen(
            [sys.executable, "-c", RING, engine], env=child_env({"PYTHONPATH": str(REPO)})
        )
        assert idle.rest(0) is True  # a worker's process rang (not the 30 s nap's end)
        assert ringer.wait(60) == 0
        assert not bell.is_set()  # heard once
    finally:
        bell.close()
