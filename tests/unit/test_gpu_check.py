"""``scripts/gpu_check.py`` cannot run here (no GPU, no CUDA build of vLLM): it imports
cleanly, and without a GPU it refuses at once, saying why, before building anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_it_imports_and_names_its_checks() -> None:
    from scripts import gpu_check

    assert gpu_check.CHECKS == ["dense", "hybrid", "block_digests", "write", "extraction_cost"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the check itself")
def test_without_a_gpu_it_refuses_clearly() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 1
    assert "gpu_check needs a CUDA GPU" in proc.stderr
    assert proc.stdout == ""  # no JSON line: nothing was checked
