"""vLLM 0.33's sleep mode around transfers, with real NIXL on CPU: the worker side driven
with real vLLM objects (tests/integration/sleep_main.py) and called as vLLM's worker calls
it at sleep (``unregister_kv_caches``) and wake (``restore_kv_caches``), the cache's
memory moved to a new address in between and the old memory overwritten.

Without the hooks, the samples shipped after the wake are read from the freed memory (and
even pass their checksums, which read the same garbage)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.support.vllm_harness import config_only_model
from tests.integration.common import run_json_main

# alone: "promptly" (under 2.5 s of a 3 s drain) is what a second test on the same cores stretches
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.alone]


def test_sleep_fails_the_unacknowledged_by_name_and_the_wake_ships_from_new_memory(tmp_path: Path) -> None:
    out = run_json_main("sleep_main.py", str(config_only_model(tmp_path / "m", 128)))
    assert out["moved"]  # the wake mapped the cache at another address
    # b0 was waiting for pages when vLLM slept: it failed by name, and the reader dropped it
    assert set(out["failures"]) == {"b0"}
    assert "vLLM went to sleep before the reader acknowledged it" in out["failures"]["b0"]
    assert out["first_sleep_s"] >= 2.5  # it had drain_timeout_s (3 s) to be acknowledged
    # d0 was in flight at the second sleep, with a trainer taking samples: it finished
    assert out["second_sleep_s"] < 2.5
    assert out["taken"] == ["a0", "c0", "d0", "e0"]
    # every sample is the states it was written with: after the wake, from the new memory
    assert all(out["exact"].values()), out["exact"]
    # each wake connected again, announcing the new registration in a new handshake
    assert out["reconnects"] == [2]
