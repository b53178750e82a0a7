"""``make bench``'s last line names the targets its medians missed, each with the ceiling
this machine allows where the run measured one (``scripts.bench.missed``)."""

from __future__ import annotations

from scripts.bench import missed


def test_a_missed_target_names_its_ceiling_and_a_met_one_is_not_listed() -> None:
    summary = {
        "d": 0.76,
        "checksum_throughput_ratio": 0.95,
        "cpu_over_raw": 1.4,
        "pull_read_over_raw": 0.6,
        "ceilings": {"xxh3_ceiling": 0.8, "checked_raw_over_raw": 0.7, "xxh3_cpu_floor": 1.35},
    }
    assert missed(summary) == [
        "d 0.76 (target >= 0.9; this machine's ceiling 0.8)",
        "cpu_over_raw 1.4 (target <= 1.3; this machine's floor 1.35)",
        "pull_read_over_raw 0.6 (target >= 0.9; this machine's ceiling 0.7)",
    ]


def test_a_target_missed_without_a_measured_bound_names_none() -> None:
    assert missed({"cpu_over_raw": 1.4, "ceilings": {}}) == ["cpu_over_raw 1.4 (target <= 1.3)"]


def test_figures_not_measured_are_not_counted_and_the_reader_memory_bound_is_checked() -> None:
    assert missed({}) == []
    over = {"reader_rss_beyond_torch_mib": 600, "reader_pool_mib": 256}
    assert missed(over) == ["reader_rss_beyond_torch_mib 600 (target <= 512)"]
    assert missed({**over, "reader_rss_beyond_torch_mib": 500}) == []
