"""``scripts/gpu_check.py`` cannot run its checks here (no GPU, no CUDA build of vLLM): it
imports cleanly, and without a GPU either tier refuses at once, saying why, before
building anything. The device tier's pieces that are pure (reading UCX's protocol tables,
the carry recipe) are checked here; tests/integration/test_gpu_device_tier.py runs the
device tier itself on host tensors and measures the carry set."""

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
    assert device_tier.CHECKS == ["integrity", "step_path", "nixl", "gpu_pool"]
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


# UCX 1.23's protocol tables (UCX_PROTO_INFO=y) as it prints them on a GPU host: one table
# per operation, a row per message-size range, transports in the last column
UCX_TABLES = """\
[1795716516.122069] [h100:2442 :0]   +--------+-------------+-----------------------------------+
[1795716516.122069] [h100:2442 :0]   | gpu-check-raw-init self cfg#0                            |
[1795716516.122069] [h100:2442 :0]   | remote memory write by ucp_put* from cuda memory to host |
[1795716516.122069] [h100:2442 :0]   +--------+-------------+-----------------------------------+
[1795716516.122069] [h100:2442 :0]   | Range  | Description |              Config               |
[1795716516.122069] [h100:2442 :0]   +--------+-------------+-----------------------------------+
[1795716516.122069] [h100:2442 :0]   |  0..8K | copy-in     | cuda_copy/cuda                    |
[1795716516.1] [h100:2442 :0]   | 8K..inf| zero-copy   | 50% on cuda_ipc/cuda and 50% on rc_mlx5/mlx5_0:1 |
[1795716516.122069] [h100:2442 :0]   +--------+-------------+-----------------------------------+
[1795716516.124710] [h100:2442 :0]   +------------+--------------------+---------------+
[1795716516.124710] [h100:2442 :0]   | gpu-check-raw-init self cfg#0                   |
[1795716516.124710] [h100:2442 :0]   | active message by ucp_am_send* from host memory |
[1795716516.124710] [h100:2442 :0]   +------------+--------------------+---------------+
[1795716516.124710] [h100:2442 :0]   |          0 | short              | tcp/lo        |
[1795716516.124710] [h100:2442 :0]   +------------+--------------------+---------------+
[1795716516.125000] [h100:2443 :0]   | remote memory read by ucp_get*(multi) into host memory from cuda |
[1795716516.125000] [h100:2443 :0]   +--------+-------------+-----------------------------------+
[1795716516.125000] [h100:2443 :0]   | 0..inf | zero-copy   | cuda_ipc/cuda                     |
"""


def test_ucx_transports_are_read_from_its_protocol_tables() -> None:
    from scripts.gpu.transfer import ucx_transports

    assert ucx_transports(UCX_TABLES) == {
        "remote memory read by ucp_get*(multi) into host memory from cuda": ["cuda_ipc/cuda"],
        "remote memory write by ucp_put* from cuda memory to host": [
            "cuda_copy/cuda",
            "cuda_ipc/cuda",
            "rc_mlx5/mlx5_0:1",
        ],
    }
    assert ucx_transports("no tables here\n") == {}


def test_the_carry_recipe_selects_python_312_manylinux_wheels() -> None:
    from scripts.gpu import carry

    cmd = carry.fetch_command(Path("/tmp/x"))
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert {"nixl-cu13==1.5.1", "nixl==1.5.1"} <= set(cmd)
    assert any(r.startswith("msgspec==") for r in cmd)
    # the wheel names pip writes: nixl_cu13-1.5.1-cp312-..., never nixl-1.5.1- for nixl-cu13
    assert [w.prefix for w in carry.WHEELS][:2] == ["nixl_cu13-1.5.1-", "nixl-1.5.1-"]
