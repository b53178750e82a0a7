"""The pull arms as ``make bench`` runs them: the READ pairings with the checks on, then
off (fewer pairs), then the DataLoader pairings; ``main()`` returns what the summary reads."""

from __future__ import annotations

import time
from typing import Any

from scripts.bench import paired
from scripts.bench.pull.loader import bench_loader
from scripts.bench.pull.read import bench_read
from scripts.bench.pull.shape import log


def main() -> dict[str, Any]:
    t0 = time.monotonic()
    out: dict[str, Any] = {"machine_start": paired.machine_state()}
    out["read"] = bench_read()
    log(f"pull_read_over_raw {out['read']['pull_read_over_raw']} in {time.monotonic() - t0:.0f} s")
    # the same with the integrity checks off at both ends (no XXH3, no values check): what
    # the protocol itself costs over the raw READ (diagnostic; fewer pairs)
    out["read_unchecked"] = bench_read(pairs=3, checks=False)
    log(f"unchecked: {out['read_unchecked']['pull_read_over_raw']} in {time.monotonic() - t0:.0f} s")
    out["loader"] = bench_loader()
    log(f"pull_over_file {out['loader']['pull_over_file']} in {time.monotonic() - t0:.0f} s")
    out["pull_read_over_raw"] = out["read"]["pull_read_over_raw"]
    out["pull_over_file"] = out["loader"]["pull_over_file"]
    out["machine_end"] = paired.machine_state()
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def part(which: str) -> dict[str, Any]:
    """One part only: "loader" (the DataLoader pairings) or "read" (the READ pairings)."""
    start = paired.machine_state()
    out = bench_loader() if which == "loader" else bench_read()
    return {**out, "machine_start": start, "machine_end": paired.machine_state()}
