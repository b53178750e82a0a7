"""``make demo``, the README's first command, on a few prompts: it ends well and prints what
a newcomer should read (every sample once, the check against transformers), with no
traceback among vLLM's lines (its chat-template warm-up cannot work without a tokenizer)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.support.deaths import program_env
from tests.engines import STARTS, Start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.fresh_engine("the demo's own engine")
def test_the_demo_ends_well_and_prints_no_traceback(tmp_path: Path) -> None:
    STARTS.count("producer", Start.FRESH)  # the demo's own engine
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.demo", "--prompts", "12", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=program_env(),
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "samples received: 12 of 12 (each exactly once: True)" in out, out[-3000:]
    assert "against transformers: relative error" in out and "(ok)" in out, out[-3000:]
    assert "Traceback" not in out and "warmup failed" not in out, out[-5000:]
