"""The GPU check's device tier: what of ours runs on a GPU without vLLM, checked in one
command on a GPU host with no package index (torch with CUDA, the carried NIXL and
msgspec wheels, no vLLM):

    python -m scripts.gpu_check --tier device

Five checks, each in a process of its own with a time limit, each ``{"ok": ..., figures}``
in the one JSON line printed at the end (10 minutes at most in all):

  integrity   a: the producer's integrity record (block digests) computed on the GPU, bit
              for bit against the reader's host reference, and its cost per GB
              (``scripts.gpu.integrity``)
  step_path   b: the producer's step path (slot-mapping copy, the step's event, the slot
              checks, the gates senders wait on) on CUDA tensors under
              ``torch.cuda.set_sync_debug_mode("error")`` (``scripts.gpu.step_path``)
  nixl        c: push and pull between two processes through our sender, reader, pull
              server and pull client from a registered GPU cache into host pools, byte for
              byte, GB/s against raw NIXL WRITE / READ of the same blocks, the time from
              a sample's finish to its tensor being usable, and the UCX transports used
              (``scripts.gpu.transfer``)
  gpu_pool    the same into pools on the GPU (``pool_device``): VRAM to VRAM, against
              raw NIXL VRAM to VRAM, every sample's tensor on the GPU; and what the pool
              does to make RDMA writes visible there (``gpudirect``)
  node_pool   push from the GPU cache into a host pool the reader offers to producers on
              its node (``node_pool=True``): the sender copies into the mapped, pinned
              pages instead of a UCX WRITE; against raw UCX WRITEs into host memory

Each pairing (push or pull, cache and pool memory) gets a line on stderr and a row of
``pairings`` in the JSON: GB/s ours and raw, ours over raw, the transports UCX picked for
ours and for raw (as the package's agents read them), and finish (or handle) to usable.
The agents run with the package's UCX defaults (``ucx_settings`` says which were in
force; ``KV_CONNECTOR_UCX_DEFAULTS=0`` runs them with UCX's own), and ``ucx_warnings``
holds what they warned where tcp carried a GPU buffer; ``--ucx-tables`` also has UCX
print its protocol tables (``UCX_PROTO_INFO=y``), read into ``ucx_tables``.

``--device cpu`` runs the same checks on host tensors (CI does, to keep the tier
runnable); its figures say nothing about a GPU. ``--plan`` fetches the wheels that must
travel (on a machine with the package index) and prints the carry set's size.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kv_connector.common.device import on_device
from scripts.gpu import carry

REPO = Path(__file__).resolve().parents[2]
# check -> (what it needs seconds for at most, on a GPU)
LIMITS_S = {"integrity": 60, "step_path": 45, "nixl": 150, "gpu_pool": 120, "node_pool": 60}
CHECKS = list(LIMITS_S)
TRANSFER_CHECKS = ("nixl", "gpu_pool", "node_pool")  # those with pairings
NEEDS = ["nixl", "msgspec", "xxhash", "numpy"]  # besides torch


def missing_modules() -> list[str]:
    return [m for m in NEEDS if importlib.util.find_spec(m) is None]


def prepare(device: str, wheels: Path) -> dict[str, str]:
    """The environment the checks run in, or ``SystemExit`` saying what is missing: a
    CUDA GPU (unless ``device`` is cpu), and NIXL and msgspec (installed from the carried
    wheels in ``wheels`` when this Python lacks them)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check --tier device needs a CUDA GPU: torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}). `--device cpu` runs the same "
            "checks on host tensors, which is what CI does and says nothing about a GPU."
        )
    env = {**os.environ}
    path = [str(REPO)]
    if missing_modules() and carry.wheel_files(wheels):
        site = carry.install(wheels)
        sys.path.insert(0, str(site))
        path.insert(0, str(site))
    missing = missing_modules()
    if missing:
        raise SystemExit(
            f"gpu_check --tier device needs {', '.join(missing)}, which this Python cannot import and "
            f"{wheels} does not hold: fetch the wheels on a machine with the package index "
            "(`python -m scripts.gpu_check --tier device --plan`) and carry that folder "
            '(docs/usage.md, "GPU check")'
        )
    env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    return env


def run_check(name: str, device: torch.device) -> dict[str, Any]:
    """One check, in this process."""
    if device.type == "cuda":
        on_device(device)  # as the package's threads do ("cuda": the current GPU)
        device = torch.device("cuda", torch.cuda.current_device())
    if name == "integrity":
        from scripts.gpu import integrity

        return integrity.check(device, share_mib=64 if device.type == "cuda" else 4)
    if name == "step_path":
        from scripts.gpu import step_path

        return step_path.check(device)
    if name == "nixl":
        from scripts.gpu import transfer

        size = transfer.GPU_SIZE if device.type == "cuda" else transfer.CPU_SIZE
        return transfer.check(device, size)
    if name == "gpu_pool":
        from scripts.gpu import transfer

        size = transfer.GPU_SIZE if device.type == "cuda" else transfer.CPU_SIZE
        return transfer.check(device, size, pool_device=str(device))
    if name == "node_pool":
        from scripts.gpu import transfer

        size = transfer.GPU_SIZE if device.type == "cuda" else transfer.CPU_SIZE
        return transfer.check_node_pool(device, size)
    raise SystemExit(f"unknown check {name!r}; the checks are {', '.join(CHECKS)}")


def spawn_check(
    name: str, device: str, env: dict[str, str], limit_s: float, tables: bool = False
) -> dict[str, Any]:
    """``run_check`` in a new process: its result, with ``tables`` the transports of UCX's
    printed protocol tables (nixl, gpu_pool)."""
    tables = tables and name in TRANSFER_CHECKS
    env = {**env, "UCX_PROTO_INFO": "y"} if tables else env
    cmd = [sys.executable, "-m", "scripts.gpu.device_tier", "--check", name, "--device", device]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as e:
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        return {"ok": False, "error": f"did not finish within {limit_s:.0f} s", "log": tail[-2000:]}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"ok": False, "error": (proc.stderr or proc.stdout).strip()[-3000:]}
    out: dict[str, Any] = {"ok": True, **json.loads(lines[-1]), "seconds": time.monotonic() - t0}
    if name in TRANSFER_CHECKS:  # what the agents warned of the transports UCX picked
        out["ucx_warnings"] = [ln for ln in proc.stderr.splitlines() if "a GPU buffer over TCP" in ln]
    if tables:
        from kv_connector.wire.ucx_report import table_transports

        out["ucx_tables"] = table_transports(proc.stdout)
    return out


def ucx_settings() -> dict[str, Any]:
    """The UCX settings the checks' agents get: the package's defaults in force (what an
    agent's NIXL ``engine_config`` holds) and the ``UCX_*`` of the environment."""
    from kv_connector.wire.ucx_report import engine_config

    return {
        "engine_config": engine_config(os.environ)[0],
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
    }


def pairing_line(row: dict[str, Any]) -> str:
    ts = ", ".join(row["transports"]) or "?"
    raw = ", ".join(row["raw_transports"]) or "?"
    return (
        f"{row['pairing']}: {row['ours_GBps']:.2f} GB/s, raw {row['raw_GBps']:.2f} "
        f"({row['of_raw']:.2f} of raw); over {ts} (raw over {raw}); "
        f"finish to usable {row['finish_to_usable_ms']:.1f} ms"
    )


def versions(device: str) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {
        "tier": "device",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name()
        if device.startswith("cuda")
        else f"cpu ({platform.machine()})",
    }
    for dist in ("nixl-cu13", "nixl-cu12", "msgspec"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.gpu_check --tier device",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--device", default="cuda", help="cuda (default) or cpu (the same checks on host tensors)"
    )
    ap.add_argument("--wheels", type=Path, default=carry.CARRY_DIR, help="the carried wheels' folder")
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks to run")
    ap.add_argument("--plan", action="store_true", help="fetch the wheels and print the carry set's size")
    ap.add_argument(
        "--ucx-tables", action="store_true", help="also have UCX print its protocol tables (UCX_PROTO_INFO=y)"
    )
    ap.add_argument("--check", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plan:
        print(
            json.dumps(
                {"carry": carry.measure(args.wheels), "fetch": " ".join(carry.fetch_command(args.wheels))}
            )
        )
        return
    if args.check:  # a child: one check, its JSON line
        print(json.dumps(run_check(args.check, torch.device(args.device))), flush=True)
        return
    names = [c for c in args.only.split(",") if c]
    for name in names:
        if name not in CHECKS:
            raise SystemExit(f"unknown check {name!r}; the checks are {', '.join(CHECKS)}")
    env = prepare(args.device, args.wheels)
    t0 = time.monotonic()
    result = versions(args.device)
    result["ucx_settings"] = ucx_settings()
    rows: list[dict[str, Any]] = []
    for name in names:
        out = spawn_check(
            name,
            args.device,
            env,
            LIMITS_S[name] * (1 if args.device.startswith("cuda") else 2),
            tables=args.ucx_tables,
        )
        result[name] = out
        print(f"gpu_check device: {name}: {'ok' if out.get('ok') else 'FAILED'}", file=sys.stderr, flush=True)
        for row in out.get("pairings", []):
            rows.append({"check": name, **row})
            print(f"gpu_check device:   {pairing_line(row)}", file=sys.stderr, flush=True)
    result["pairings"] = rows
    result["ok"] = all(result[n].get("ok") for n in names)
    result["seconds"] = time.monotonic() - t0
    print(json.dumps(result), flush=True)
    if not result["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
