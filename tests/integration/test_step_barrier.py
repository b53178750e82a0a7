"""No host sync per step: the engine step hands its slot mapping over and goes on; the
sender reads a shipped request's blocks (credit request, checksum, WRITE) only once the
step's event is done, and the slot-mapping check that runs then still fails a request
whose slots disagree with its block table, by name. Real vLLM objects, a real reader,
real NIXL (tests/integration/barrier_main.py); the step's CUDA event is the host
stand-in, held "not done" by the test.

Before, the step shipped at once and relied on a stream synchronize in the step: here the
sample went out while the device was still busy."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.support.vllm_harness import config_only_model
from tests.integration.common import run_json_main

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_nothing_is_read_before_the_step_is_done_and_late_slot_errors_fail_by_name(tmp_path: Path) -> None:
    out = run_json_main("barrier_main.py", str(config_only_model(tmp_path / "m", 128)))
    for rid in ("a0", "b0"):  # while the device was busy: the engine stepped on, nothing was read
        busy = out[f"{rid}_busy"]
        assert busy == {"step_s": busy["step_s"], "taken": False, "bytes": 0, "finished": False}
    # b0's slots were one off: found when its step was done, after it was shipped
    assert out["failures"] == {
        "b0": "positions 0..32 were not written where the block table puts them with block size 16"
    }
    assert out["taken"] == ["a0", "c0"]
    assert all(out["exact"].values()), out["exact"]
