"""``pull_over_file``, ``rank_agent_over_worker_clients`` and the ceiling
``manifest_only_over_file``: speculators' own DataLoader (``loader_proc``, a process of its
own per loader) on the vLLM servers of ``servers``, in pairs of loaders."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scripts.bench import paired
from scripts.bench.pull.servers import Server, servers
from scripts.bench.pull.shape import (
    LOADER_PAIRS,
    NULL_ARM,
    REPO,
    ROW_TOKENS,
    ROWS,
    SERVED,
    SPECULATORS_SITE,
    UDS_SITE,
    WARMUP,
    WORKER_POOL_MIB,
    WORKERS,
    log,
    spread,
)


class Loader:
    """speculators' DataLoader in a process of its own (``loader_proc``), one epoch of the
    train split per ``round()``."""

    def __init__(
        self,
        backend: str,
        data: Path,
        server: Server,
        hs_dir: Path | None,
        rows: int,
        workers: int = WORKERS,
        fetch_agent: str = "rank",
        pool_mib: int | None = None,
    ) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(UDS_SITE), str(REPO), str(SPECULATORS_SITE)]),
            "KV_TEST_OPENAI_UDS": str(server.socket_path),
            # glibc raises its mmap threshold after the first 16 MiB row is freed, and the
            # rows after come from arenas it keeps: each of the 24 spawned workers of a
            # pairing grew ~680 -> ~880 MiB, and the kernel's OOM killer ended two runs.
            # A fixed threshold returns every row's memory when it is freed (both arms).
            "MALLOC_MMAP_THRESHOLD_": str(4 << 20),
        }
        args = [str(data), backend, str(hs_dir or ""), str(rows), str(workers), fetch_agent]
        args.append(str(pool_mib or 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.bench.pull.loader_proc", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=REPO, text=True,
        )  # fmt: skip
        self.backend, self.server = backend, server
        self.name = backend if backend != "kv-hidden-states" else f"pull ({fetch_agent})"
        self.profile: list[dict[str, float]] = []

    def _ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} loader died ({self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def ready(self) -> None:
        self._ask("ready")

    def spawn(self) -> None:
        """Start the DataLoader's workers (answered by ``spawned``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("spawn\n")
        self.proc.stdin.flush()

    def spawned(self) -> None:
        assert self.proc.stdout is not None
        if not self.proc.stdout.readline():
            raise RuntimeError(f"the {self.backend} loader died ({self.proc.wait()})")

    def consumers(self) -> dict[str, Any]:
        """What fetches for this loader (one trainer rank): the processes under it that
        made a NIXL agent, and the consumer agents the producer says it served for it
        (named by the pid that made them, ``kv_connector.speculators.agent_name``) with the
        pool each registered."""
        tree = self._ask("count")
        pids = {tree["pid"], *tree["descendants"]}
        served: dict[str, int] = {}
        for line in self.server.log.read_text(errors="replace").splitlines():
            m = SERVED.search(line)
            if m and int(m.group(2)) in pids:
                served[m.group(1)] = int(m.group(3))
        return {
            "nixl_agent_processes": len(tree["nixl_agent_pids"]),
            "consumer_agents": len(served),
            "registered_mib": sum(served.values()),
            "workers": len(tree["workers"]),
            "memory_mib": tree["pss_mib"],  # the rank's processes' proportional set size
        }

    def round(self) -> paired.Run:
        before = self.server.metrics()
        r = self._ask("round")
        after = self.server.metrics()
        if r["errors"] or r["rows"] != r["expected"]:
            raise RuntimeError(f"{self.name}: a round gave {r}")
        prof = {k: v - before.get(k, 0.0) for k, v in after.items()}
        prof.update({f"workers_{k}_s": v for k, v in r["workers_s"].items()})
        prof["round_s"] = r["seconds"]
        self.profile.append(prof)
        log(f"{self.name}: {r['rows']} rows in {r['seconds']:.1f} s")
        return paired.Run(r["seconds"], r["rows"], r["bytes"], r["cpu_s"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self._ask("quit")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


@contextlib.contextmanager
def loaders(*made: Loader) -> Iterator[tuple[Loader, ...]]:
    """Loaders with their workers started (all at once: the workers' start-up is most of
    a first round); stopped on exit."""
    try:
        for ld in made:
            ld.ready()
        t0 = time.monotonic()
        for ld in made:
            ld.spawn()
        for ld in made:
            ld.spawned()
        names = ", ".join(ld.name for ld in made)
        log(f"{names}: DataLoader workers started in {time.monotonic() - t0:.0f} s")
        yield made
    finally:
        for ld in made:
            ld.stop()


class _Pairings:
    """The three pairings' results: ``a`` rank agent over worker clients, ``p`` pull over
    file, ``c`` manifest-only over file; ``counts`` what fetches for each rank; the rank
    and file loaders, whose profiles the result reads."""

    a: paired.Pairs
    p: paired.Pairs
    c: paired.Pairs
    counts: dict[str, Any]
    rank: Loader
    file: Loader


def _run_pairings(work: Path, rows: int, pairs: int, warmup: int) -> _Pairings:
    """The three pairings, each with only its two loaders alive (12 workers each)."""
    out = _Pairings()
    with servers(work, "pull") as (pull_server,):
        log(f"DataLoader rounds of {rows} rows of {ROW_TOKENS} tokens, {WORKERS} workers per loader")

        def pull_loader(mode: str, pool_mib: int | None = None, tag: str = "") -> Loader:
            data = work / f"data-{mode}{tag}"
            return Loader(
                "kv-hidden-states", data, pull_server, None, rows, fetch_agent=mode, pool_mib=pool_mib
            )

        with loaders(pull_loader("rank"), pull_loader("worker", WORKER_POOL_MIB)) as (rank, worker):
            out.a = paired.run_pairs(rank.round, worker.round, pairs=pairs, warmup=warmup)
            log(f"rank agent over per-worker clients: {[round(x, 3) for x in out.a.ratio().values]}")
            out.counts = {"rank": rank.consumers(), "worker": worker.consumers()}
            log(f"what fetches for one rank: {out.counts}")
        # Two loaders of 12 workers and two servers barely fit 23 GiB, and a DataLoader
        # worker grows by ~200 MiB over a pairing's rounds (two of three make bench runs
        # lost the file server to the kernel's OOM killer): the pull loader that faces the
        # file backend starts afresh, beside it, so that both arms' workers are as old.
        with servers(work, "file") as (file_server,):
            out.rank = pull_loader("rank", tag="-p")
            out.file = Loader("file", work / "data-file", file_server, work / "hs-cache", rows)
            with loaders(out.rank, out.file) as (rank, _):
                out.p = paired.run_pairs(rank.round, out.file.round, pairs=pairs, warmup=warmup)
                log(f"profile: pull {rank.profile[-1]}, file {out.file.profile[-1]}")
                rank.stop()  # the ceiling: the pull backend with nothing read, over the file backend
                null_loader = Loader(NULL_ARM, work / "data-null", pull_server, None, rows)
                with loaders(null_loader) as (null,):
                    out.c = paired.run_pairs(null.round, out.file.round, pairs=pairs, warmup=warmup)
                    log(f"manifest-only over file: {[round(x, 3) for x in out.c.ratio().values]}")
    return out


def _per_row(ld: Loader, first: int, pairs: int, rows: int) -> dict[str, Any]:
    """Where a row's time goes (medians over the counted rounds of the first pairing it is
    in, seconds per row): the server's request time (queue + prefill, from its /metrics)
    and the workers' get_generated and delete (summed over the workers), beside the
    round's wall time per row."""
    rounds = ld.profile[first : first + pairs]
    return {k: round(statistics.median(r.get(k, 0.0) for r in rounds) / rows, 4) for k in rounds[0]}


def bench_loader(pairs: int = LOADER_PAIRS, warmup: int = WARMUP, rows: int = ROWS) -> dict[str, Any]:
    """Three pairings, each with only its two loaders alive (12 workers each): our pull
    backend with the rank's fetch agent over the same with a client per worker (and what
    each runs: NIXL agents, the pools the producer served); over the file backend; and
    the manifest-only ceiling over the file backend."""
    work = Path(tempfile.mkdtemp(prefix="hs-bench-pull-"))
    (work / "hs-cache").mkdir()  # the file backend's cache directory: empty, every row generated
    try:
        r = _run_pairings(work, rows, pairs, warmup)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med, rng = r.p.ratio().rounded()
    ceiling, ceiling_rng = r.c.ratio().rounded()
    agent_ratio, agent_rng = r.a.ratio().rounded()
    return {
        "pull_over_file": med,
        "range": rng,
        "manifest_only_over_file": ceiling,
        "manifest_only_range": ceiling_rng,
        "rank_agent_over_worker_clients": agent_ratio,
        "rank_agent_range": agent_rng,
        "per_rank": r.counts,
        "workers": WORKERS,
        "rank_rows_per_s": spread([x.rate for x in r.a.a]),
        "worker_rows_per_s": spread([x.rate for x in r.a.b]),
        "pull_rows_per_s": spread([x.rate for x in r.p.a]),
        "file_rows_per_s": spread([x.rate for x in r.p.b]),
        "pull_GB_per_s": spread([x.gb_per_s for x in r.p.a]),
        "file_GB_per_s": spread([x.gb_per_s for x in r.p.b]),
        "rows_per_round": rows,
        "profile_s_per_row": {
            "pull": _per_row(r.rank, warmup, pairs, rows),
            "file": _per_row(r.file, warmup, pairs, rows),
        },
        "file_output_dir": f"{work}/example-out (local disk, {tempfile.gettempdir()})",
    }
