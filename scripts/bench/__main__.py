"""``make bench``: every arm in turn, each arm's result as a line as it ends, then the
summary (``scripts.bench.summary``: the figures, their ceilings and the targets missed)
as one JSON object, the last line printed. The first and the last lines name the machine
and its load.

    python -m scripts.bench               # every arm; needs an idle machine: on 2 cores about
                                          # 33-36 minutes on AVX-512 (AMD EPYC), over 40 on AVX2
                                          # (its model arm alone 16; docs/benchmarks.md)
    python -m scripts.bench --only ARM    # one arm alone: its line, then its figures as the last
    python -m scripts.bench --only keep   # the arms: model, datapath, step, pull, protocol, fp8,
                                          # integrity, audit, keep

Stopped (Ctrl-C, SIGTERM, SIGHUP), it ends every process its arms started, vLLM's servers
with their engines included, and exits 130 (143 for SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from scripts.bench.paired import machine_state
from scripts.bench.summary import flatten, summarise
from scripts.support.stopping import Terminated, exit_status, raise_on_termination

ARMS = ("model", "datapath", "step", "pull", "protocol", "fp8", "integrity", "audit", "keep")


def run_arm(name: str) -> dict[str, Any]:
    """One arm's result (its module's ``main()``)."""
    from scripts.bench import audit, datapath, fp8, integrity, keep, model, protocol, step
    from scripts.bench.pull import run as pull

    mains: dict[str, Callable[[], dict[str, Any]]] = {
        "model": model.main,
        "datapath": datapath.main,
        "step": step.main,
        "pull": pull.main,
        "protocol": protocol.main,
        "fp8": fp8.main,
        "integrity": integrity.main,
        "audit": audit.main,
        "keep": keep.main,
    }
    return mains[name]()


def only(name: str, start: dict[str, Any], t0: float) -> None:
    """One arm alone: its line, then its figures as the last line."""
    from scripts.bench import keep

    out = run_arm(name)
    print(f"{name}:", json.dumps(flatten(out)), flush=True)
    if name == "protocol":
        last = {k: v for k, v in out.items() if not k.startswith(("push_", "pull_4"))}
    else:
        last = keep.figures(out) if name == "keep" else flatten(out)
    end = machine_state()
    last["machine"] = {**start, "load_avg_end": end["load_avg"]}
    last["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(last), flush=True)


def everything(start: dict[str, Any], t0: float) -> None:
    from scripts.bench import keep

    out: dict[str, dict[str, Any]] = {}
    labels = {"model": "model-level", "datapath": "data path", "step": "per step", "fp8": "fp8 files",
              "integrity": "integrity records", "audit": "logprob audit"}  # fmt: skip
    for name in ARMS:
        out[name] = run_arm(name)
        print(f"{labels.get(name, name)}:", json.dumps(flatten(out[name])), flush=True)
    summary = summarise(out["model"], out["datapath"], out["step"], out["pull"], out["fp8"], out["protocol"])
    summary["integrity_cpu_s_per_GB"] = {
        layout: {"producer": m["producer_cpu_s_per_GB"], "reader": m["reader_cpu_s_per_GB"]}
        for layout, m in out["integrity"].items()
    }
    summary["audit_ms_per_sample"] = out["audit"]["audit_ms_per_sample"]
    summary["audit_share_of_consumer_cpu"] = out["audit"]["audit_share_of_consumer_cpu"]
    summary.update(keep.figures(out["keep"]))
    end = machine_state()
    summary["machine"] = {**start, "load_avg_start": start["load_avg"], "load_avg_end": end["load_avg"]}
    del summary["machine"]["load_avg"]
    summary["seconds"] = round(time.time() - t0, 1)
    print("machine at end:", json.dumps(end), flush=True)
    print(json.dumps(summary), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__)
    ap.add_argument("--only", choices=ARMS, help="run this arm alone")
    arm = ap.parse_args().only
    raise_on_termination()  # SIGTERM/SIGHUP unwind like Ctrl-C: every arm stops what it started
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    start = machine_state()
    print("machine at start:", json.dumps(start), flush=True)
    t0 = time.time()
    try:
        if arm is not None:
            only(arm, start, t0)
        else:
            everything(start, t0)
    except KeyboardInterrupt as e:
        print(f"stopped ({e or 'SIGINT'}) after {time.time() - t0:.0f} s", flush=True)
        return exit_status(e) if isinstance(e, Terminated) else 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
