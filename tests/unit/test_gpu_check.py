"""``scripts/gpu_check.py`` cannot run its checks here (no GPU, no CUDA build of vLLM): it
imports cleanly, and without a GPU either tier refuses at once, saying why, before
building anything. The device tier's carry recipe is checked here (its reading of UCX's
tables is ``kv_connector.wire.ucx_report``'s, tests/unit/wire/test_ucx_report.py);
tests/integration/test_gpu_device_tier.py runs the device tier itself on host tensors and
measures the carry set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run_gpu_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scripts.gpu_check", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_it_imports_and_names_its_checks() -> None:
    from scripts import gpu_check
    from scripts.gpu import device_tier

    assert gpu_check.CHECKS == ["dense", "hybrid", "block_digests", "write", "extraction_cost"]
    assert device_tier.CHECKS == ["integrity", "step_path", "nixl", "gpu_pool", "node_pool"]
    assert sum(device_tier.LIMITS_S.values()) <= 8 * 60  # the tier's promise on one H100


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the check itself")
@pytest.mark.parametrize("tier", [[], ["--tier", "vllm"]])
def test_without_a_gpu_the_vllm_tier_refuses_clearly(tier: list[str]) -> None:
    proc = run_gpu_check(*tier)
    assert proc.returncode == 1
    assert "gpu_check needs a CUDA GPU" in proc.stderr
    assert proc.stdout == ""  # no JSON line: nothing was checked


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the check itself")
def test_without_a_gpu_the_device_tier_refuses_clearly() -> None:
    proc = run_gpu_check("--tier", "device")
    assert proc.returncode == 1
    assert "gpu_check --tier device needs a CUDA GPU" in proc.stderr
    assert "--device cpu" in proc.stderr  # and says what runs instead
    assert proc.stdout == ""


def test_an_unknown_device_check_is_refused() -> None:
    proc = run_gpu_check("--tier", "device", "--device", "cpu", "--only", "integrity,warp")
    assert proc.returncode != 0
    assert "unknown check 'warp'" in proc.stderr
    assert proc.stdout == ""


def test_the_carry_recipe_selects_python_312_manylinux_wheels() -> None:
    from scripts.gpu import carry

    cmd = carry.fetch_command(Path("/tmp/x"))
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert {"nixl-cu13==1.5.1", "nixl==1.5.1"} <= set(cmd)
    assert any(r.startswith("msgspec==") for r in cmd)
    # the wheel names pip writes: nixl_cu13-1.5.1-cp312-..., never nixl-1.5.1- for nixl-cu13
    assert [w.prefix for w in carry.WHEELS][:2] == ["nixl_cu13-1.5.1-", "nixl-1.5.1-"]
