"""The data-path pairings as ``make bench`` runs them: e (the default integrity record,
fingerprints) against r, e0, em and b; ex (the diagnostic full hash, XXH3), rc, ra and ea
against r; each arm in a process of its own. ``main()`` returns the figures the summary reads
(``scripts.bench.summary``)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from scripts.bench.datapath.arm_process import ArmProcess, isolated
from scripts.bench.datapath.shape import BLOCK, HIDDEN, TOKEN_BYTES, say
from scripts.bench.paired import Pairs, Run, Spread, run_pairs


def main(n_req: int = 48, tokens: int = 2048, pairs: int = 7) -> dict[str, Any]:
    from scripts.support.vllm_harness import config_only_model

    work = Path(tempfile.mkdtemp(prefix="hs-bench-"))
    model = config_only_model(work / "wide-llama", HIDDEN, num_layers=4)
    arms = _start_arms(model, n_req, tokens)
    try:
        measured = _measure(arms, n_req, tokens, pairs)
    finally:
        finals = _close(arms)
        shutil.rmtree(work, ignore_errors=True)
    out = _figures(measured)
    out["e_final"] = finals.get("e", {})
    out["values_check"] = isolated("bench_values_check", tokens)
    return out


def _start_arms(model: Path, n_req: int, tokens: int) -> dict[str, ArmProcess]:
    """Every arm's processes, started together (each builds its arm while the others do)."""
    nb = -(-tokens // BLOCK)
    num_blocks = 4 * nb + 1
    pool = 4 * nb * BLOCK * TOKEN_BYTES
    return {
        "e": ArmProcess("OursArm", model, n_req, tokens, num_blocks, pool),
        "e0": ArmProcess("OursArm", model, n_req, tokens, num_blocks, pool, "none"),
        "em": ArmProcess("OursArm", model, n_req, tokens, num_blocks, pool, "auto", False),
        "ex": ArmProcess("OursArm", model, n_req, tokens, num_blocks, pool, "xxh3"),
        "r": ArmProcess("RawArm", n_req, tokens, num_blocks, 4),
        "rc": ArmProcess("RawArm", n_req, tokens, num_blocks, 4, True),
        "ra": ArmProcess("RawArm", n_req, tokens, num_blocks, 4, False, True),
        "ea": ArmProcess("RawEngineArm", model, n_req, tokens, num_blocks, pool),
        "b": ArmProcess("ExampleArm", model, n_req, tokens, num_blocks),
    }


def _measure(arms: dict[str, ArmProcess], n_req: int, tokens: int, pairs: int) -> dict[str, Pairs]:
    """e against r, e0, em and b in pairs; then ex, rc, ra and ea against r."""
    for arm in arms.values():
        arm.ready()
    say(f"arms ready; {pairs} pairs per ratio, {n_req} samples of {tokens} tokens a round")
    e = arms["e"]
    measured: dict[str, Pairs] = {}
    for other in ("r", "e0", "em", "b"):
        measured[other] = run_pairs(e.round, arms[other].round, pairs)
        say(f"e vs {other}: {[round(x, 3) for x in measured[other].ratio().values]}")
    # the diagnostic mode: every byte hashed at both ends, over raw WRITEs
    measured["ex"] = run_pairs(arms["ex"].round, arms["r"].round, pairs)
    say(f"ex vs r: {[round(x, 3) for x in measured['ex'].ratio().values]}")
    # its ceiling: raw WRITEs with XXH3 at both ends, no protocol
    measured["rc"] = run_pairs(arms["rc"].round, arms["r"].round, pairs)
    say(f"rc vs r: {[round(x, 3) for x in measured['rc'].ratio().values]}")
    # e's ceiling: raw WRITEs whose blocks are reused only once the target has the sample
    measured["ra"] = run_pairs(arms["ra"].round, arms["r"].round, pairs)
    say(f"ra vs r: {[round(x, 3) for x in measured['ra'].ratio().values]}")
    # the same inside vLLM's engine: e's harness and steps, a connector that only WRITEs and holds
    measured["ea"] = run_pairs(arms["ea"].round, arms["r"].round, pairs)
    say(f"ea vs r: {[round(x, 3) for x in measured['ea'].ratio().values]}")
    return measured


def _close(arms: dict[str, ArmProcess]) -> dict[str, dict[str, float]]:
    """Every arm closed, a failure reported and the others closed still: their closing reports."""
    finals: dict[str, dict[str, float]] = {}
    for name, arm in arms.items():
        try:
            finals[name] = arm.close()
        except Exception as exc:  # report it, and close the others
            say(f"closing {name}: {exc}")
    return finals


def _gb(r: Run) -> float:
    return r.gb_per_s


def _per_gb(r: Run) -> float:
    return r.cpu_s_per_gb


def _post_per_gb(r: Run) -> float:
    return r.detail["post_s"] / (r.nbytes / 1e9)


def _busy(r: Run) -> float:
    return r.detail["post_s"] / r.seconds


def _figures(measured: dict[str, Pairs]) -> dict[str, Any]:
    """The ratios and rates the summary reads, from the pairs as measured."""
    d = measured["r"]
    e_runs = [r for name, p in measured.items() if name not in ("rc", "ex", "ra", "ea") for r in p.a]
    out: dict[str, Any] = {
        "d": d.ratio(_gb),
        "cpu_over_raw": d.ratio(_per_gb),
        "checksum_throughput_ratio": measured["e0"].ratio(),
        "metrics_throughput_ratio": measured["em"].ratio(),
        "e_over_b": measured["b"].ratio(),
        "e_GB_per_s": Spread.of([_gb(r) for r in e_runs]),
        "e_tokens_per_s": Spread.of([r.rate for r in e_runs]),
        "raw_nixl_GB_per_s": d.each("b", _gb),
        "b_tokens_per_s": measured["b"].each("b"),
        "e0_GB_per_s": measured["e0"].each("b", _gb),
        "cpu_s_per_GB": Spread.of([_per_gb(r) for r in e_runs]),
        "raw_cpu_s_per_GB": d.each("b", _per_gb),
        "e0_cpu_s_per_GB": measured["e0"].each("b", _per_gb),
        "d_xxh3": measured["ex"].ratio(_gb),
        "cpu_over_raw_xxh3": measured["ex"].ratio(_per_gb),
        "xxh3_ceiling": measured["rc"].ratio(_gb),
        "xxh3_cpu_floor": measured["rc"].ratio(_per_gb),
        "acked_raw_over_raw": measured["ra"].ratio(_gb),
        "engine_acked_raw_over_raw": measured["ea"].ratio(_gb),
        # d's parts: how much longer e's copies took per GB than r's (the posts, where this
        # machine's shared-memory path copies), and the part of each round spent copying
        "copy_s_per_GB_over_raw": d.ratio(_post_per_gb),
        "writer_busy": d.each("a", _busy),
        "raw_writer_busy": d.each("b", _busy),
    }
    for end in ("producer", "reader"):
        key = f"{end}_cpu_s"
        out[f"{end}_cpu_s_per_GB"] = Spread.of([r.detail[key] / (r.nbytes / 1e9) for r in e_runs])
        out[f"e0_{end}_cpu_s_per_GB"] = Spread.of(
            [r.detail[key] / (r.nbytes / 1e9) for r in measured["e0"].b]
        )
        out[f"raw_{end}_cpu_s_per_GB"] = Spread.of([r.detail[key] / (r.nbytes / 1e9) for r in d.b])
    return out
