"""``make bench``'s DataLoader arms at a tiny size, on one pair of vLLM servers started for
the module (ours in pull delivery; vLLM's ExampleHiddenStatesConnector made CPU-safe,
writing files), as ``python -m scripts.bench.pull`` and ``scripts.bench.keep`` use them:

- the keep arm (``scripts.bench.keep``): two trainer ranks of speculators' own DataLoader,
  three epochs with the rank-kept sampler (vLLM is asked for each row once, and epochs
  2-3 read every row from the ranks' folders), then speculators' file backend on rank 0's
  folder and three epochs with speculators' own sampler; every figure of the summary line
  is there;
- the loader arms (``scripts.bench.pull.loader``): speculators' own DataLoader on each
  server (ours with the rank's fetch agent and with a client per worker), plus the
  manifest-only arm (the pull backend less its data) on the pull server, one round of a
  few rows per arm, and what fetches for each loader (one trainer rank): the NIXL agents
  its processes made and the consumer agents the producer served it. Every row arrives
  (speculators checks each row's tokens and counts the rows it could not get), the file
  arm's files are deleted as the file backend does, the pull server holds nothing after
  the pull arms, and the profile is read from both servers and every loader.

The last test stops the servers and checks that nothing is left running. Minutes, not
seconds; the figures themselves are ``python -m scripts.bench``'s."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.bench import keep
from scripts.bench.pull.loader import Loader, loaders
from scripts.bench.pull.servers import Server, servers
from scripts.bench.pull.shape import HIDDEN, LAYER_IDS, NULL_ARM, ROW_TOKENS
from tests.e2e.common import speculators_site

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROWS = 2
WORKERS = 2
SHARED = "the DataLoader arms' two servers, started once for this module"


@dataclass
class ArmServers:
    work: Path
    pull: Server
    file: Server
    stack: contextlib.ExitStack

    def stop(self) -> None:
        """Both servers stopped (as the bench stops them), before the module ends."""
        self.stack.close()


@pytest.fixture(scope="module")
def arm_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ArmServers]:
    speculators_site()  # skips without speculators
    work = tmp_path_factory.mktemp("arms")
    (work / "hs-cache").mkdir()
    with contextlib.ExitStack() as stack:
        pull, file = stack.enter_context(servers(work))
        yield ArmServers(work, pull, file, stack)


@pytest.mark.fresh_engine(SHARED)
def test_the_keep_arm_fetches_each_row_once_with_the_rank_kept(
    arm_servers: ArmServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keep, "ROWS", 6)
    monkeypatch.setattr(keep, "WORKERS", 1)
    monkeypatch.setattr(keep, "PAIRS", 1)
    out = keep.main(arm_servers.pull)
    figures = keep.figures(out)
    assert set(keep.FIGURES) <= set(figures)
    assert out["keep_prompts_over_rows"] == 1.0 and out["keep_hit_rate_rank_kept"] == 1.0, out
    assert out["samplers"] == ["RankKeptBatchSampler", "RankKeptBatchSampler"]
    assert out["default_sampler"] == "MultipackDistributedBatchSamplerV2"
    assert 0.0 <= out["keep_hit_rate_default_sampler"] <= 1.0
    assert out["keep_prompts_over_rows_default_sampler"] >= 1.0
    assert out["keep_over_file"] > 0 and 0.99 < out["keep_bytes_over_file"] < 1.1
    kept = out["epochs_detail"]["rank_kept"]
    assert [sum(e["rows"] for e in rank[:3]) for rank in kept] == [9, 9]  # 3 rows a rank, 3 epochs
    assert all(e["fetched"] == 0 for rank in kept for e in rank[1:])


@pytest.mark.fresh_engine(SHARED)
def test_every_loader_arm_delivers_every_row_and_counts_what_fetches(arm_servers: ArmServers) -> None:
    work, pull_server, file_server = arm_servers.work, arm_servers.pull, arm_servers.file
    made = [
        Loader("kv-hidden-states", work / "d-rank", pull_server, None, ROWS, WORKERS, "rank"),
        Loader("kv-hidden-states", work / "d-worker", pull_server, None, ROWS, WORKERS, "worker"),
        # one worker where no claim counts workers: each worker is a spawned process
        Loader("file", work / "d-file", file_server, work / "hs-cache", ROWS, 1),
        Loader(NULL_ARM, work / "d-null", pull_server, None, ROWS, 1),
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
    arm_servers.stop()
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
