"""Deterministic producer-side data for integration tests, and an independent reference
of what the reader must rebuild from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from kv_connector.wire.layout import BlockLayout

REPO = Path(__file__).resolve().parents[2]


def make_cache(layout: BlockLayout, num_blocks: int, seed: int, finite: bool = False) -> torch.Tensor:
    """[num_blocks, *block_shape] of random bits (every byte pattern, NaNs included), or
    with ``finite`` random normal values (what the reader CLI's value check accepts)."""
    g = torch.Generator().manual_seed(seed)
    if finite:
        values = torch.randn(num_blocks, *layout.block_shape(), generator=g)
        return values.to(getattr(torch, layout.dtype))
    nbytes = num_blocks * layout.block_bytes
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(getattr(torch, layout.dtype)).view(num_blocks, *layout.block_shape())


def token_ids(request_id: str, n: int) -> list[int]:
    h = sum(map(ord, request_id))
    return [(h * 31 + i * 7) % 50000 for i in range(n)]


def expected_states(cache: torch.Tensor, layout: BlockLayout, block_ids: list[int], n: int) -> torch.Tensor:
    """Token by token, straight from the cache: [n, layers, hidden]."""
    rows = []
    for t in range(n):
        b, off = block_ids[t // layout.block_size], t % layout.block_size
        rows.append(cache[b, :, off, :] if layout.layout == "LTH" else cache[b, off, :, :])
    return torch.stack(rows)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def layout_dict(layout: BlockLayout) -> dict[str, Any]:
    return dict(
        layout=layout.layout,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        dtype=layout.dtype,
    )


def child_env(overrides: dict[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with ``overrides`` (None: the variable is unset)."""
    env = dict(os.environ)
    for k, v in (overrides or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def start_sender(spec: dict[str, Any], env: dict[str, str | None] | None = None) -> subprocess.Popen[str]:
    """Run tests/integration/sender_main.py with ``spec`` in a new process."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "integration" / "sender_main.py"), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(env),
    )


def finish_sender(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"sender timed out; stderr:\n{err[-4000:]}") from None
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"sender printed no result (rc={proc.returncode}); stderr:\n{err[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    result["rc"] = proc.returncode
    result["stderr"] = err
    return result


def run_json_main(script: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run tests/integration/SCRIPT with ``args`` in a new process; its last JSON line."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "integration" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stderr[-4000:], proc.stdout[-2000:])
    result: dict[str, Any] = json.loads(lines[-1])
    return result
