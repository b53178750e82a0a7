"""``scripts.bench.pull.loader``'s DataLoader arms at a tiny size: both vLLM servers (our
connector in pull delivery; vLLM's ExampleHiddenStatesConnector made CPU-safe, writing
files) and speculators' own DataLoader on each (ours with the rank's fetch agent and with
a client per worker), plus the manifest-only arm (the pull backend less its data) on the
pull server, one round of a few rows per arm, and what fetches for each loader (one
trainer rank): the NIXL agents its processes made and the consumer agents the producer
served it. Every row
arrives (speculators checks each row's tokens and values itself and counts the rows it
could not get), the file arm's files are deleted as the file backend does, the pull
server holds nothing after either pull arm, the profile is read from both servers and
every loader, and nothing is left running. Minutes, not
seconds (two servers start); the figures themselves are ``python -m scripts.bench.pull``'s."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from scripts.bench.pull.loader import Loader, loaders
from scripts.bench.pull.servers import servers
from scripts.bench.pull.shape import HIDDEN, LAYER_IDS, NULL_ARM, ROW_TOKENS
from tests.e2e.common import speculators_site

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROWS = 2
WORKERS = 2


@pytest.mark.fresh_engine("the arm's own two servers")
def test_every_loader_arm_delivers_every_row_and_counts_what_fetches(tmp_path: Path) -> None:
    speculators_site()  # skips without speculators
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    (work / "hs-cache").mkdir()
    with servers(work) as (pull_server, file_server):
        made = [
            Loader("kv-hidden-states", work / "d-rank", pull_server, None, ROWS, WORKERS, "rank"),
            Loader("kv-hidden-states", work / "d-worker", pull_server, None, ROWS, WORKERS, "worker"),
            Loader("file", work / "d-file", file_server, work / "hs-cache", ROWS, WORKERS),
            Loader(NULL_ARM, work / "d-null", pull_server, None, ROWS, WORKERS),
        ]
        with loaders(*made) as arms:
            runs = [ld.round() for ld in arms]
            counts = [ld.consumers() for ld in arms]
            procs = [ld.proc for ld in arms]
        procs += [pull_server.proc, file_server.proc]
        leftovers = sorted(p.name for p in (work / "example-out").glob("*.safetensors"))
        deadline = time.monotonic() + 20  # a fenced release gets no answer: taken when it comes
        while True:
            metrics = pull_server.metrics_text().splitlines()
            held = [line for line in metrics if line.startswith("vllm:kv_cache_usage_perc")]
            if any(float(line.rsplit(" ", 1)[1]) != 0.0 for line in held) and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            break
    assert held and all(float(line.rsplit(" ", 1)[1]) == 0.0 for line in held)  # every row released
    for run, ld in zip(runs, arms, strict=True):
        assert run.units == ROWS and run.nbytes == ROWS * ROW_TOKENS * len(LAYER_IDS) * HIDDEN * 2
        prof = ld.profile[-1]
        assert prof["server_request_s"] > 0 and prof["server_prefill_s"] > 0
        assert prof["workers_get_generated_s"] > 0 and "workers_delete_s" in prof
    rank, worker, file, _null = counts
    # the rank's fetch agent: one process made a NIXL agent, the producer served one, one pool
    one = {"nixl_agent_processes": 1, "consumer_agents": 1, "registered_mib": 1024, "workers": WORKERS}
    assert {k: rank[k] for k in one} == one and rank["memory_mib"] > 1024  # the agent's pool is in it
    # a client per worker: one agent per worker that fetched, each with its own pool
    assert 1 <= worker["consumer_agents"] == worker["nixl_agent_processes"] <= WORKERS, worker
    assert worker["registered_mib"] == 256 * worker["consumer_agents"] and worker["workers"] == WORKERS
    assert file["consumer_agents"] == 0 and file["nixl_agent_processes"] == 0
    assert leftovers == []  # each row's file was read and deleted
    for p in procs:
        assert p.poll() is not None
    for server in (pull_server, file_server):  # their process groups are empty
        with pytest.raises(ProcessLookupError):
            os.killpg(server.proc.pid, 0)
