"""``make bench``'s last line names the targets its medians missed, each with the ceiling
this machine allows where the run measured one (``scripts.bench.summary.missed``)."""

from __future__ import annotations

from scripts.bench.summary import missed


def test_a_missed_target_names_its_ceiling_and_a_met_one_is_not_listed() -> None:
    summary = {
        "d": 0.76,
        "checksum_throughput_ratio": 0.95,
        "cpu_over_raw": 1.4,
        "pull_read_over_raw": 0.6,
        "ceilings": {"xxh3_ceiling": 0.8, "checked_raw_over_raw": 0.7, "xxh3_cpu_floor": 1.35},
    }
    assert missed(summary) == [
        "d 0.76 (target >= 0.95)",  # the default record bounds it at raw (no full hash)
        "cpu_over_raw 1.4 (target <= 1.15)",
        "pull_read_over_raw 0.6 (target >= 0.93; this machine's ceiling 0.7)",
    ]
    # the diagnostic full hash's figures are reported beside their ceilings, not held to targets
    assert missed({**summary, "d": 0.96, "cpu_over_raw": 1.1, "d_xxh3": 0.6, "cpu_over_raw_xxh3": 1.5}) == [
        "pull_read_over_raw 0.6 (target >= 0.93; this machine's ceiling 0.7)"
    ]


def test_d_names_the_ceiling_of_a_design_that_keeps_a_sample_until_its_reader_has_it() -> None:
    """Inside vLLM's engine (e's harness): the raw WRITEs alone, without the engine, are reported."""
    ceilings = {"engine_acked_raw_over_raw": 0.93, "acked_raw_over_raw": 0.99}
    assert missed({"d": 0.9, "ceilings": ceilings}) == ["d 0.9 (target >= 0.95; this machine's ceiling 0.93)"]


def test_a_over_a0_names_the_ceiling_of_a_connector_that_only_writes_each_prompts_blocks() -> None:
    assert missed({"a_over_a0": 0.95, "ceilings": {"raw_connector_over_a0": 0.96}}) == [
        "a_over_a0 0.95 (target >= 0.97; this machine's ceiling 0.96)"
    ]
    # the repeated batch's figure is reported beside its own ceiling, not held to the target
    assert missed({"a_over_a0_prefix_cached": 0.85, "ceilings": {}}) == []


def test_a_target_missed_without_a_measured_bound_names_none() -> None:
    assert missed({"cpu_over_raw": 1.4, "ceilings": {}}) == ["cpu_over_raw 1.4 (target <= 1.15)"]


def test_figures_not_measured_are_not_counted_and_the_reader_memory_bound_is_checked() -> None:
    assert missed({}) == []
    over = {"reader_rss_beyond_torch_mib": 600, "reader_pool_mib": 256}
    assert missed(over) == ["reader_rss_beyond_torch_mib 600 (target <= 512)"]
    assert missed({**over, "reader_rss_beyond_torch_mib": 500}) == []


def test_pull_over_file_within_five_percent_of_its_ceiling_and_one_agent_per_rank() -> None:
    ceilings = {"manifest_only_over_file": 1.1}
    assert missed({"pull_over_file": 1.06, "ceilings": ceilings}) == []
    assert missed({"pull_over_file": 1.02, "ceilings": ceilings}) == [
        "pull_over_file 1.02 (target: within 5% of its ceiling 1.1)"
    ]
    assert missed({"pull_over_file": 0.98, "ceilings": {"manifest_only_over_file": 1.0}}) == [
        "pull_over_file 0.98 (target >= 1.0; this machine's ceiling 1.0)"
    ]
    one = {"nixl_agent_processes": 1, "consumer_agents": 1, "registered_mib": 1024, "workers": 12}
    assert missed({"per_rank": {"rank": one}}) == []
    twelve = {**one, "nixl_agent_processes": 12, "consumer_agents": 12}
    assert missed({"per_rank": {"rank": twelve}})[0].startswith("per_rank.rank")
    assert missed({"rank_agent_over_worker_clients": 0.97}) == [
        "rank_agent_over_worker_clients 0.97 (target >= 1.0)"
    ]


def test_the_small_sample_figures_are_held_within_ten_percent_of_their_ceilings() -> None:
    ceilings = {"acked_raw_over_raw_4MiB": 0.9, "checked_raw_4MiB_over_raw": 0.8}
    assert missed({"d_4MiB": 0.82, "pull_read_4MiB_over_raw": 0.73, "ceilings": ceilings}) == []
    assert missed({"d_4MiB": 0.8, "pull_read_4MiB_over_raw": 0.7, "ceilings": ceilings}) == [
        "d_4MiB 0.8 (target: within 10% of its ceiling acked_raw_over_raw_4MiB 0.9)",
        "pull_read_4MiB_over_raw 0.7 (target: within 10% of its ceiling checked_raw_4MiB_over_raw 0.8)",
    ]
    # a run that measured d's CPU bound names it beside the miss
    bounds = {"d_cpu_bound_4MiB": 0.5}
    assert missed({"d_4MiB": 0.3, "ceilings": ceilings, "bounds": bounds}) == [
        "d_4MiB 0.3 (target: within 10% of its ceiling acked_raw_over_raw_4MiB 0.9;"
        " its CPU per sample bounds it at 0.5)"
    ]


def test_the_engine_thread_targets_are_held_on_the_decode_steps_totals() -> None:
    figures = {
        "decode_256_output_tokens": {"total": 1240.0, "worker.wait_for_save": 700.0},
        "decode_256": {"total": 12.5},
        "prefill_per_1k_tokens": {"total": 800.0},  # reported, no target
    }
    assert missed({"engine_thread_us": figures}) == [
        "engine_thread_us.decode_256_output_tokens 1240.0 (target <= 300.0)"
    ]
    figures["decode_256"] = {"total": 31.0}
    figures["decode_256_output_tokens"] = {"total": 299.0}
    assert missed({"engine_thread_us": figures}) == ["engine_thread_us.decode_256 31.0 (target <= 30.0)"]
