"""Deterministic producer-side data for integration tests, and an independent reference
of what the reader must rebuild from it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kv_connector.wire.layout import BlockLayout
from scripts.support.deaths import FAULT_ENV, explain

if TYPE_CHECKING:
    from kv_connector.reader import HiddenStatesReader, Sample

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "kv_connector.reader"]  # the reader CLI

# the caches the sender processes ship from, and the samples planned on them
NUM_CACHE_BLOCKS = 64
CPU_LAYOUT = BlockLayout("LTH", 16, 3, 64, "float32")
GPU_LAYOUT = BlockLayout("TLH", 16, 4, 96, "bfloat16")


def plan(sizes: list[int], seed: int, layout: BlockLayout) -> list[dict[str, Any]]:
    """Samples of the given token counts on scattered, shuffled cache blocks."""
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(sizes):
        nb = -(-n // layout.block_size)
        out.append(
            {
                "request_id": f"s{seed}-{i}",
                "num_tokens": n,
                "block_ids": rng.sample(range(NUM_CACHE_BLOCKS), nb),
            }
        )
    return out


def check(
    samples: dict[str, Sample],
    spec_samples: list[dict[str, Any]],
    layout: BlockLayout,
    seed: int,
    pad_bytes: int = 0,
) -> None:
    cache = make_cache(layout, NUM_CACHE_BLOCKS, seed, pad_bytes=pad_bytes)
    assert set(samples) == {s["request_id"] for s in spec_samples}
    for s in spec_samples:
        got = samples[s["request_id"]]
        assert got.token_ids.tolist() == token_ids(s["request_id"], s["num_tokens"])
        assert got.hidden_states.shape == (s["num_tokens"], layout.num_layers, layout.hidden_size)
        assert same_bytes(got.hidden_states, expected_states(cache, layout, s["block_ids"], s["num_tokens"]))


def collect(reader: HiddenStatesReader, n: int, timeout: float = 60) -> dict[str, Sample]:
    got: dict[str, Sample] = {}
    for _ in range(n):
        s = reader.get(timeout=timeout, copy=True)  # kept for the checks: a copy
        assert s.request_id not in got, f"{s.request_id} delivered twice"
        got[s.request_id] = s
    return got


def make_cache(
    layout: BlockLayout, num_blocks: int, seed: int, finite: bool = True, pad_bytes: int = 0
) -> torch.Tensor:
    """[num_blocks, *block_shape] of random normal values (``finite``: what a reader's
    values screen, on by default, accepts), or of random bits (every byte pattern, NaNs
    included: for a reader with ``check_values=False``).
    ``pad_bytes``: blocks lie ``block_bytes + pad_bytes`` apart, as in a KV cache group
    whose page vLLM padded, the padding random bits too (never to be shipped)."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layout.dtype)
    if finite:
        values = torch.randn(num_blocks, *layout.block_shape(), generator=g).to(dtype)
        if not pad_bytes:
            return values
    pitch = layout.block_bytes + pad_bytes
    raw = torch.randint(0, 256, (num_blocks * pitch,), dtype=torch.uint8, generator=g)
    blocks = raw.view(num_blocks, pitch)[:, : layout.block_bytes]
    if finite:
        blocks.copy_(values.reshape(num_blocks, -1).view(torch.uint8))
    return blocks.view(dtype).view(num_blocks, *layout.block_shape())


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
        env=child_env({"OMP_NUM_THREADS": "1", **FAULT_ENV, "PYTHONPATH": str(REPO)}),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    why = explain(proc.stdout + proc.stderr, proc.returncode, script)
    assert proc.returncode == 0 and lines, (proc.returncode, why, proc.stderr[-4000:], proc.stdout[-2000:])
    result: dict[str, Any] = json.loads(lines[-1])
    return result


class Senders:
    """Real sender processes (``tests/integration/sender_main.py``) started by one test;
    those still running when it ends are killed."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, spec: dict[str, Any], env: dict[str, str | None] | None = None) -> subprocess.Popen[str]:
        """A sender process running ``spec``."""
        proc = start_sender(spec, env)
        self.procs.append(proc)
        return proc

    def ship(
        self,
        reader: HiddenStatesReader,
        layout: BlockLayout,
        seed: int,
        samples: list[dict[str, Any]],
        **extra: Any,
    ) -> subprocess.Popen[str]:
        """A sender process shipping ``samples`` to ``reader`` from the deterministic cache
        of ``seed`` (``NUM_CACHE_BLOCKS`` blocks in ``layout``); ``extra``: more of the
        spec (producer_id, rank, world_size, checksum, faults: see sender_main.py)."""
        spec = dict(
            address=reader.address,
            layout=layout_dict(layout),
            num_cache_blocks=NUM_CACHE_BLOCKS,
            seed=seed,
            samples=samples,
        )
        return self.start({**spec, **extra})

    def deliver(
        self,
        reader: HiddenStatesReader,
        layout: BlockLayout,
        seed: int,
        samples: list[dict[str, Any]],
        timeout: float = 60,
        **extra: Any,
    ) -> tuple[dict[str, Sample], dict[str, Any]]:
        """Ship ``samples``, take every one of them from ``reader`` (as copies), and wait
        for the sender's result."""
        proc = self.ship(reader, layout, seed, samples, **extra)
        got = collect(reader, len(samples), timeout=timeout)
        return got, finish_sender(proc)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def start_cli(out: Path, *args: str, **kw: Any) -> tuple[subprocess.Popen[str], str]:
    """The reader CLI on any free port; returns it and the address it printed."""
    cli = subprocess.Popen(
        [*CLI, "--listen", "127.0.0.1:0", "--out", str(out), "--pool-mib", "1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )
    assert cli.stdout is not None
    address = cli.stdout.readline().strip()
    assert address, cli.communicate()[1][-3000:]
    return cli, address


def stop_cli(cli: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    """Wait for the reader CLI to exit (killed after ``timeout``): its status and stderr."""
    try:
        rc = cli.wait(timeout=timeout)
    finally:
        if cli.poll() is None:
            cli.kill()
        _, err = cli.communicate()
    return rc, err
