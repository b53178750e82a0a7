"""The summary of ``make bench`` (``python -m scripts.bench``): every ratio of the
producer-connector, data-path and pull issues, each from alternating pairs run back to
back in one process tree (``scripts.bench.paired``: a warm-up pair not counted, then at
least 5 pairs, A B then B A ...), reported as the median of the pair ratios with its min
and max (``"d": 0.93, "d_range": [0.88, 0.97]``). The last line printed is one JSON
object; the first and the last name the machine and its load.

  a_over_c   tiny-model prefill tokens/s with extraction + connector + reader, over the
             same vLLM without extraction;
  a_over_a0  the same over vLLM with extraction and no connector (the connector's own cost),
             each round a batch of new prompts; ``a_over_a0_prefix_cached`` (reported) the
             same batch every round, most of each prompt served by vLLM's prefix cache;
  e_over_b   the data path's ceiling (our connector's worker side driven with real vLLM
             objects, no model compute, GPU-sized states, into a reader that takes every
             sample on lease) over vLLM's ExampleHiddenStatesConnector into /dev/shm;
  d          e's bytes/s (the default integrity record, fingerprints; metrics on) over a raw
             NIXL WRITE of the same blocks; ``d_xxh3`` the same with the diagnostic full hash;
  cpu_over_raw  e's CPU seconds per GB (both processes' rusage) over the raw WRITE's
             (``cpu_over_raw_xxh3``: with the full hash);
  checksum_throughput_ratio  e with its integrity record over e without;
  metrics_throughput_ratio   e with metrics on over e with them off;
  engine_thread_us  the CPU microseconds each of the connector's hooks spends on the
             thread that calls it (vLLM's engine thread; its worker's), medians:
             per decode step at 256 requests with and without output tokens, per
             thousand prefill tokens; ``raw`` the bench's raw connector's in the same
             harness (``scripts.bench.step``); targets: at most 300 and 30 per decode step;
  step_ms / metadata_bytes   the connector's cost per engine step at 256 decoding
             requests with output tokens, at 2k and 32k context;
  reader_rss_mib  the reader process's peak resident memory in e (its pool, torch, NIXL);
  values_check_GB_per_s  the reader's optional NaN/Inf/all-zero check on one thread;
  pull_read_over_raw  the pull client's fetch GB/s (checks on) over a raw NIXL READ of the
             same blocks between the same two processes (``scripts.bench.pull.read``), and
             ``pull_read_unchecked_over_raw`` the same with the checks off;
  pull_over_file  rows/s through speculators' DataLoader (12 workers) with our pull backend
             (the rank's fetch agent) over its file backend, same server settings;
  rank_agent_over_worker_clients  rows/s of the same DataLoader with the rank's one fetch
             agent over a client (NIXL agent and pool) per worker; ``per_rank``: for each,
             the processes that made a NIXL agent, the consumer agents the producer served
             the rank and the MiB they registered;
  fp8        the reader CLI's fp8 files (``scripts.bench.fp8``): rows/s over bf16 files
             (paired), bytes per row of each, and each scaling's worst relative error per
             captured layer on a real-looking sample.

  ceilings   what this machine allows any design, measured in the same run: for a_over_c,
             vLLM's own cost of extraction (``a0_over_c``, paired); for a_over_a0, a
             connector that only WRITEs each prompt's blocks to a raw target by NIXL
             over vLLM with extraction and no connector (``raw_connector_over_a0``, and
             ``_prefix_cached`` for the repeated batch); for d, the bench's raw
             connector in e's harness rank and steps (vLLM's engine objects, no model),
             which WRITEs each prompt's blocks and holds them until the target
             acknowledged their sample (``engine_acked_raw_over_raw``), and the same
             WRITEs and acks without the engine (``acked_raw_over_raw``: raw WRITEs from a
             cache of e's size, reported); for d_xxh3 and
             the checksum ratio, raw WRITEs with XXH3 at both ends (no protocol) over
             plain raw WRITEs (``xxh3_ceiling``; their CPU seconds per GB over the plain
             ones', ``xxh3_cpu_floor``, is the floor of cpu_over_raw); for pull_read_over_raw, raw READs with
             the client's default checks (fingerprint, sampled values screen), over plain raw READs
             (``checked_raw_over_raw``); for pull_over_file, the DataLoader with the pull
             backend less its data (nothing READ, copied or checked) over the file
             backend (``manifest_only_over_file``). A target above its ceiling is out of
             reach here.
"""

from __future__ import annotations

from typing import Any

from scripts.bench.paired import Spread

# figure -> (">=" or "<=", target), checked on the medians
TARGETS: dict[str, tuple[str, float]] = {
    "d": (">=", 0.95),
    "checksum_throughput_ratio": (">=", 0.9),
    "a_over_c": (">=", 0.95),
    "a_over_a0": (">=", 0.97),
    "e_over_b": (">=", 1.5),
    "cpu_over_raw": ("<=", 1.15),
    "pull_over_file": (">=", 1.0),
    "rank_agent_over_worker_clients": (">=", 1.0),
    "pull_read_over_raw": (">=", 0.93),
}


def flatten(figures: dict[str, Any], digits: int = 3) -> dict[str, Any]:
    """A Spread becomes ``key: median`` and ``key_range: [min, max]``."""
    out: dict[str, Any] = {}
    for key, value in figures.items():
        if isinstance(value, Spread):
            out[key], out[f"{key}_range"] = value.rounded(digits)
        else:
            out[key] = value
    return out


# figure -> the ceiling that bounds it on this machine (``ceilings`` in the summary)
CEILINGS: dict[str, str] = {
    "d": "engine_acked_raw_over_raw",
    "d_xxh3": "xxh3_ceiling",
    "cpu_over_raw_xxh3": "xxh3_cpu_floor",
    "pull_read_over_raw": "checked_raw_over_raw",
    "pull_over_file": "manifest_only_over_file",
    "a_over_c": "a0_over_c",
    "a_over_a0": "raw_connector_over_a0",
    "a_over_a0_prefix_cached": "raw_connector_over_a0_prefix_cached",
}


# engine-thread microseconds per decode step at 256 requests (``engine_thread_us``, totals)
ENGINE_THREAD_US: dict[str, float] = {"decode_256_output_tokens": 300.0, "decode_256": 30.0}


# figures whose target is within 10% of their ceiling (``scripts.bench.protocol``)
NEAR_CEILING: dict[str, str] = {
    "d_4MiB": "acked_raw_over_raw_4MiB",
    "pull_read_4MiB_over_raw": "checked_raw_4MiB_over_raw",
}
# where a run measured it, the bound its own CPU per sample puts on a figure above
CPU_BOUNDS: dict[str, str] = {"d_4MiB": "d_cpu_bound_4MiB"}


def missed(summary: dict[str, Any]) -> list[str]:
    """The targets a median missed (figures this run did not measure are not counted),
    each with this machine's ceiling for it where the run measured one."""
    out = []
    ceilings = summary.get("ceilings", {})
    for key, (op, target) in TARGETS.items():
        if key not in summary:
            continue
        value = summary[key]
        if (op == ">=" and value < target) or (op == "<=" and value > target):
            bound = ceilings.get(CEILINGS.get(key, ""))
            word = "ceiling" if op == ">=" else "floor"
            at = f"; this machine's {word} {bound}" if bound is not None else ""
            out.append(f"{key} {value} (target {op} {target}{at})")
    for key, bound_key in NEAR_CEILING.items():
        bound = ceilings.get(bound_key)
        if key in summary and bound is not None and summary[key] < 0.9 * bound:
            cpu = summary.get("bounds", {}).get(CPU_BOUNDS.get(key, ""))
            at = f"; its CPU per sample bounds it at {cpu}" if cpu is not None else ""
            out.append(f"{key} {summary[key]} (target: within 10% of its ceiling {bound_key} {bound}{at})")
    ceiling = ceilings.get("manifest_only_over_file")
    if "pull_over_file" in summary and ceiling is not None and summary["pull_over_file"] < 0.95 * ceiling:
        out.append(f"pull_over_file {summary['pull_over_file']} (target: within 5% of its ceiling {ceiling})")
    rank = summary.get("per_rank", {}).get("rank")
    if rank is not None and (rank["consumer_agents"] != 1 or rank["nixl_agent_processes"] != 1):
        out.append(f"per_rank.rank {rank} (target: one NIXL agent, one pool per trainer rank)")
    for key, limit in ENGINE_THREAD_US.items():
        figure = summary.get("engine_thread_us", {}).get(key, {}).get("total")
        if figure is not None and figure > limit:
            out.append(f"engine_thread_us.{key} {figure} (target <= {limit})")
    if "reader_rss_beyond_torch_mib" in summary:
        limit = summary["reader_pool_mib"] + 256  # the reader's own memory: its pool plus 256 MiB
        if summary["reader_rss_beyond_torch_mib"] > limit:
            out.append(
                f"reader_rss_beyond_torch_mib {summary['reader_rss_beyond_torch_mib']} (target <= {limit})"
            )
    return out


def summarise(
    model: dict[str, Any],
    datapath: dict[str, Any],
    steps: dict[str, Any],
    pull: dict[str, Any],
    fp8: dict[str, Any],
    protocol: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The last line's figures from each arm's result (``main()`` of ``model``,
    ``datapath``, ``step``, ``pull.run``, ``fp8`` and ``protocol``), with the targets they missed."""
    summary = _figures(model, datapath, steps, pull)
    summary["profile"] = _profile(model, datapath)
    summary["ceilings"] = _ceilings(model, datapath, pull)
    if protocol is not None:
        for key in ("d_1MiB", "d_4MiB", "pull_read_4MiB_over_raw", "protocol_us_per_sample", "bounds"):
            summary[key] = protocol[key]
        summary["ceilings"].update(protocol["ceilings"])
    summary["fp8"] = {**fp8["writer"], "worst_relative_error": fp8["error"]}
    summary["missed"] = missed(summary)
    return summary


def _figures(
    model: dict[str, Any], datapath: dict[str, Any], steps: dict[str, Any], pull: dict[str, Any]
) -> dict[str, Any]:
    e_final = datapath["e_final"]
    figures: dict[str, Any] = {
        "a_over_c": model["a_over_c"],
        "a_over_a0": model["a_over_a0"],
        "a_over_a0_prefix_cached": model["a_over_a0_prefix_cached"],
        "e_over_b": datapath["e_over_b"],
        "d": datapath["d"],
        "checksum_throughput_ratio": datapath["checksum_throughput_ratio"],
        "metrics_throughput_ratio": datapath["metrics_throughput_ratio"],
        "cpu_over_raw": datapath["cpu_over_raw"],
        "d_xxh3": datapath["d_xxh3"],
        "cpu_over_raw_xxh3": datapath["cpu_over_raw_xxh3"],
        "cpu_s_per_GB": datapath["cpu_s_per_GB"],
        "raw_cpu_s_per_GB": datapath["raw_cpu_s_per_GB"],
        "a_tokens_per_s": model["a_tokens_per_s"],
        "c_tokens_per_s": model["c_tokens_per_s"],
        "a0_tokens_per_s": model["a0_tokens_per_s"],
        "e_GB_per_s": datapath["e_GB_per_s"],
        "raw_nixl_GB_per_s": datapath["raw_nixl_GB_per_s"],
        "b_tokens_per_s": datapath["b_tokens_per_s"],
    }
    summary = flatten(figures)
    summary["pull_read_over_raw"] = pull["read"]["pull_read_over_raw"]
    summary["pull_read_over_raw_range"] = pull["read"]["range"]
    summary["pull_read_unchecked_over_raw"] = pull["read_unchecked"]["pull_read_over_raw"]
    summary["pull_over_file"] = pull["loader"]["pull_over_file"]
    summary["pull_over_file_range"] = pull["loader"]["range"]
    summary["rank_agent_over_worker_clients"] = pull["loader"]["rank_agent_over_worker_clients"]
    summary["rank_agent_over_worker_clients_range"] = pull["loader"]["rank_agent_range"]
    summary["per_rank"] = {**pull["loader"]["per_rank"], "workers": pull["loader"]["workers"]}
    summary.update(
        {
            "step_ms": {k: round(v["step_ms"], 3) for k, v in steps.items() if k.startswith("ctx_")},
            "metadata_bytes": {k: int(v["metadata_bytes"]) for k, v in steps.items() if k.startswith("ctx_")},
            "engine_thread_us": steps["engine_thread_us"],
            "reader_rss_mib": round(e_final["reader_rss_mib"]),
            "reader_rss_beyond_torch_mib": round(e_final["reader_rss_beyond_torch_mib"]),
            "reader_pool_mib": round(e_final["reader_pool_mib"]),
            "values_check_GB_per_s": round(datapath["values_check"]["GB_per_s"], 2),
        }
    )
    return summary


def _profile(model: dict[str, Any], datapath: dict[str, Any]) -> dict[str, Any]:
    """Where the time goes (medians over the counted rounds): the data path's CPU seconds
    per GB by end, with checksums and without; d's parts (e's copy time per GB over r's,
    and the part of a round each spent copying: d is about
    ``writer_busy / raw_writer_busy / copy_s_per_GB_over_raw``); the model-level arm's
    generate() and tail."""
    profile = {
        key: datapath[key].rounded()[0]
        for key in (
            "producer_cpu_s_per_GB", "reader_cpu_s_per_GB", "e0_producer_cpu_s_per_GB",
            "e0_reader_cpu_s_per_GB", "e0_cpu_s_per_GB", "raw_producer_cpu_s_per_GB",
            "raw_reader_cpu_s_per_GB", "copy_s_per_GB_over_raw", "writer_busy", "raw_writer_busy",
        )
    }  # fmt: skip
    keys = ["a_generate_s", "a0_generate_s", "a_tail_s", "a_prefix_cached_generate_s"]
    keys += ["a0_prefix_cached_generate_s", "a_prefix_cached_tail_s"]
    profile.update({key: model[key].rounded()[0] for key in keys})
    return profile


def _ceilings(model: dict[str, Any], datapath: dict[str, Any], pull: dict[str, Any]) -> dict[str, Any]:
    """What this machine allows any design, measured in the same run (``CEILINGS`` names
    the figure each bounds)."""
    return {
        **flatten(
            {
                "a0_over_c": model["a0_over_c"],
                "raw_connector_over_a0": model["raw_connector_over_a0"],
                "raw_connector_over_a0_prefix_cached": model["raw_connector_over_a0_prefix_cached"],
                "xxh3_ceiling": datapath["xxh3_ceiling"],
                "xxh3_cpu_floor": datapath["xxh3_cpu_floor"],
                "acked_raw_over_raw": datapath["acked_raw_over_raw"],
                "engine_acked_raw_over_raw": datapath["engine_acked_raw_over_raw"],
            }
        ),
        "checked_raw_over_raw": pull["read"]["checked_raw_over_raw"],
        "checked_raw_range": pull["read"]["checked_raw_range"],
        "manifest_only_over_file": pull["loader"]["manifest_only_over_file"],
        "manifest_only_range": pull["loader"]["manifest_only_range"],
    }
