"""What the protocol costs per sample, at samples small enough that the copy no longer
hides it: push and pull against raw NIXL transfers of the same bytes, in pairs.

Push (e, the data path's harness rank and reader) runs against r (raw WRITEs), ra (raw
WRITEs reused only once acknowledged) and ea (the bench's raw connector in e's engine steps,
held until acknowledged: the ceiling). Pull runs against raw READs and the checked raw READ.
A sample is one cache block of 128 tokens x 4 layers in host memory: hidden 1024 makes it
1 MiB, hidden 4096 makes it 4 MiB. The depth is the data-path arms': 4 samples in flight.

Figures: ``d_1MiB`` and ``d_4MiB`` (e's GB/s over r's) with their ceilings
``acked_raw_over_raw_*`` (ea over r); ``pull_read_4MiB_over_raw`` with
``checked_raw_4MiB_over_raw``; ``protocol_us_per_sample``, the CPU microseconds a sample
costs each end beyond its ceiling arm's (medians over pairs of e against ea); and
``d_cpu_bound_*``, the ``d`` that e's CPU per sample alone allows on the cores this run may
use (both ends' CPU seconds per sample over the cores: no schedule of its threads can move a
sample faster), so a target above it is shown to need less CPU, not shorter waits.

    python -m scripts.bench.protocol     # about 2 minutes on 2 cores; prints JSON last
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench.datapath.arm_process import ArmProcess
from scripts.bench.datapath.shape import BLOCK, LAYERS
from scripts.bench.paired import Pairs, Run, machine_state, run_pairs

SIZES = {"1MiB": 1024, "4MiB": 4096}  # sample name -> the hidden size that makes one block of it
SAMPLES = {"1MiB": 512, "4MiB": 192}  # samples per round (about 0.5 and 0.75 GiB)
IN_FLIGHT = 4
PAIRS = 5


def say(text: str) -> None:
    print(f"[bench.protocol {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _us_per_sample(p: Pairs, key: str, n: int) -> float:
    """The median over pairs of (A's CPU seconds at one end - B's) per sample, in us."""
    diffs = [(a.detail[key] - b.detail[key]) / n * 1e6 for a, b in zip(p.a, p.b, strict=True)]
    return round(statistics.median(diffs), 1)


def _cpu_us(runs: list[Run], n: int) -> dict[str, float]:
    """Each end's CPU microseconds per sample, the median over ``runs``."""
    return {
        end: round(statistics.median(r.detail[f"{end}_cpu_s"] for r in runs) / n * 1e6, 1)
        for end in ("producer", "reader")
    }


def push(name: str, pairs: int = PAIRS) -> dict[str, Any]:
    """e, r and ra at one sample size, each in a process of its own; e and ra against r."""
    from scripts.support.vllm_harness import config_only_model

    hidden, n = SIZES[name], SAMPLES[name]
    work = Path(tempfile.mkdtemp(prefix="hs-bench-protocol-"))
    model = config_only_model(work / "llama", hidden, num_layers=len(LAYERS))
    num_blocks = IN_FLIGHT + 1
    pool = IN_FLIGHT * BLOCK * len(LAYERS) * hidden * 2
    arms = {
        "e": ArmProcess("OursArm", model, n, BLOCK, num_blocks, pool),
        "r": ArmProcess("RawArm", n, BLOCK, num_blocks, IN_FLIGHT, False, False, hidden),
        "ra": ArmProcess("RawArm", n, BLOCK, num_blocks, IN_FLIGHT, False, True, hidden),
        "ea": ArmProcess("RawEngineArm", model, n, BLOCK, num_blocks, pool, hidden),
    }
    try:
        for arm in arms.values():
            arm.ready()
        d = run_pairs(arms["e"].round, arms["r"].round, pairs)
        say(f"{name}: e vs r {[round(x, 3) for x in d.ratio(_gb).values]}")
        ra = run_pairs(arms["ra"].round, arms["r"].round, pairs)
        say(f"{name}: ra vs r {[round(x, 3) for x in ra.ratio(_gb).values]}")
        ea = run_pairs(arms["ea"].round, arms["r"].round, pairs)
        say(f"{name}: ea vs r {[round(x, 3) for x in ea.ratio(_gb).values]}")
        cost = run_pairs(arms["e"].round, arms["ea"].round, pairs)
        say(f"{name}: e vs ea {[round(x, 3) for x in cost.ratio(_gb).values]}")
    finally:
        for arm in arms.values():
            try:
                arm.close()
            except Exception as exc:  # report it, and close the others
                say(f"closing an arm: {exc}")
        shutil.rmtree(work, ignore_errors=True)
    med, rng = d.ratio(_gb).rounded()
    ceiling, crng = ea.ratio(_gb).rounded()
    r_us = statistics.median(r.seconds for r in d.b) / n * 1e6
    cores = len(os.sched_getaffinity(0))
    e_cpu = _cpu_us(d.a, n)
    floor_us = (e_cpu["producer"] + e_cpu["reader"]) / cores  # e's CPU spread over every core
    return {
        "d": med, "d_range": rng, "engine_acked_raw_over_raw": ceiling, "engine_acked_raw_range": crng,
        "acked_raw_over_raw": ra.ratio(_gb).rounded()[0],
        "e_over_engine_acked_raw": cost.ratio(_gb).rounded()[0],
        "samples_per_round": n,
        "us_per_sample": {
            "e": round(statistics.median(r.seconds for r in d.a) / n * 1e6, 1),
            "ea": round(statistics.median(r.seconds for r in ea.a) / n * 1e6, 1),
            "r": round(r_us, 1),
        },
        "cpu_us_per_sample": {"e": e_cpu, "ea": _cpu_us(ea.a, n), "cores": cores},
        "d_cpu_bound": round(r_us / floor_us, 3),
        # beyond the raw WRITE held until acknowledged in the same engine steps (ea)
        "protocol_us_per_sample": {
            "producer": _us_per_sample(cost, "producer_cpu_s", n),
            "reader": _us_per_sample(cost, "reader_cpu_s", n),
        },
    }  # fmt: skip


def pull(name: str, pairs: int = PAIRS) -> dict[str, Any]:
    """The pull client against raw READs (and the checked raw READ, its ceiling) at one size."""
    from scripts.bench.pull.read import bench_read

    out = bench_read(pairs=pairs, samples=SAMPLES[name] // 2, tokens=BLOCK, hidden=SIZES[name])
    n = out["samples_per_round"]
    per_sample = {
        end: round((out["pull"]["cpu_s_per_GB"][end]["median"] - out["raw"]["cpu_s_per_GB"][end]["median"])
                   * out["pull"]["GB_per_round"] / n * 1e6, 1)
        for end in ("producer", "consumer")
    }  # fmt: skip
    return {
        "pull_read_over_raw": out["pull_read_over_raw"],
        "range": out["range"],
        "checked_raw_over_raw": out["checked_raw_over_raw"],
        "ms_per_sample": {k: out["ms_per_sample"][k] for k in ("pull", "raw")},
        "protocol_us_per_sample": per_sample,
    }


def _gb(r: Run) -> float:
    return r.gb_per_s


def main(pairs: int = PAIRS) -> dict[str, Any]:
    t0 = time.monotonic()
    start = machine_state()
    out: dict[str, Any] = {}
    for name in SIZES:
        out[f"push_{name}"] = push(name, pairs)
        say(f"push {name}: {json.dumps(out[f'push_{name}'])}")
    out["pull_4MiB"] = pull("4MiB", pairs)
    say(f"pull 4MiB: {json.dumps(out['pull_4MiB'])}")
    out["d_1MiB"] = out["push_1MiB"]["d"]
    out["d_4MiB"] = out["push_4MiB"]["d"]
    out["pull_read_4MiB_over_raw"] = out["pull_4MiB"]["pull_read_over_raw"]
    out["ceilings"] = {
        "acked_raw_over_raw_1MiB": out["push_1MiB"]["engine_acked_raw_over_raw"],
        "acked_raw_over_raw_4MiB": out["push_4MiB"]["engine_acked_raw_over_raw"],
        "checked_raw_4MiB_over_raw": out["pull_4MiB"]["checked_raw_over_raw"],
    }
    out["bounds"] = {
        "d_cpu_bound_1MiB": out["push_1MiB"]["d_cpu_bound"],
        "d_cpu_bound_4MiB": out["push_4MiB"]["d_cpu_bound"],
    }
    out["protocol_us_per_sample"] = {
        "push_4MiB": out["push_4MiB"]["protocol_us_per_sample"],
        "push_1MiB": out["push_1MiB"]["protocol_us_per_sample"],
        "pull_4MiB": out["pull_4MiB"]["protocol_us_per_sample"],
    }
    out["machine"] = {"start": start, "end": machine_state()}
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
