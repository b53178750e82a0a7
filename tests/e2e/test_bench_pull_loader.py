"""``scripts.bench_pull``'s ``pull_over_file`` arms at a tiny size: both vLLM servers (our
connector in pull delivery; vLLM's ExampleHiddenStatesConnector made CPU-safe, writing
files) and speculators' own DataLoader on each, plus the manifest-only arm (the pull
backend less its data) on the pull server, one round of a few rows per arm. Every row
arrives (speculators checks each row's tokens and values itself and counts the rows it
could not get), the file arm's files are deleted as the file backend does, the pull
server holds nothing after either pull arm, the profile is read from both servers and
every loader, and nothing is left running. Minutes, not
seconds (two servers start); the figures themselves are ``python -m scripts.bench_pull``'s."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from scripts import bench_pull as bp
from tests.e2e.test_speculators import speculators_site

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROWS = 2


def test_both_loader_arms_deliver_every_row(tmp_path: Path) -> None:
    speculators_site()  # skips without speculators
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    with bp.servers_and_loaders(work, ROWS) as (pull, file, null):
        runs = [pull.round(), file.round(), null.round()]
        procs = [pull.proc, file.proc, null.proc, pull.server.proc, file.server.proc]
        leftovers = sorted(p.name for p in (work / "example-out").glob("*.safetensors"))
        held = [
            line
            for line in pull.server.metrics_text().splitlines()
            if line.startswith("vllm:kv_cache_usage_perc")
        ]
    assert held and all(float(line.rsplit(" ", 1)[1]) == 0.0 for line in held)  # every row released
    for run, ld in zip(runs, (pull, file, null), strict=True):
        assert run.units == ROWS and run.nbytes == ROWS * bp.TOKENS * len(bp.LAYER_IDS) * bp.HIDDEN * 2
        prof = ld.profile[-1]
        assert prof["server_request_s"] > 0 and prof["server_prefill_s"] > 0
        assert prof["workers_get_generated_s"] > 0 and "workers_delete_s" in prof
    assert leftovers == []  # each row's file was read and deleted
    for p in procs:
        assert p.poll() is not None
    for server in (pull.server, file.server):  # their process groups are empty
        with pytest.raises(ProcessLookupError):
            os.killpg(server.proc.pid, 0)
