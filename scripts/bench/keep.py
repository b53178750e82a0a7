"""Capture once, train many (``--kv-hs-keep``), measured with speculators' own DataLoader:

    python -m scripts.bench.keep      # alone: progress on stderr, the figures as the last line

Two trainer ranks (two processes, rank 0 and 1 of 2, each its own keep folder: two
nodes) on one vLLM server in pull delivery (the pull arms' shape: hidden 4096, 4 captured
layers, bf16, ``ROW_TOKENS``-token rows of 16 MiB; ``WORKERS`` DataLoader workers per
rank), three epochs each:

- ``keep_prompts_over_rows``: the prompts vLLM served over the three epochs of both ranks
  with the rank-kept sampler (``--kv-hs-sampler rank-kept``), over the rows (1.0: each
  row computed once); ``keep_hit_rate_rank_kept``: the share of epochs 2-3 rows read from
  the rank's folder.
- ``keep_hit_rate_default_sampler``: the same with speculators' own sampler, which
  reshuffles rows across ranks: the share of epochs 2-3 rows the rank's node had kept
  (the rest fetched from vLLM again); ``keep_prompts_over_rows_default_sampler`` beside it.
- ``keep_first_batch_s``: rank 0's first batch of epoch 1 (its workers' start included),
  streamed from vLLM; ``capture_then_train_first_batch_s``: capturing rank 0's rows first
  (its whole epoch 1, each row fetched and kept) and then its first batch from the folder.
- ``keep_over_file``: rows/s of later epochs (every row from the folder, verified) over
  speculators' ``file`` backend reading the same folder with the same sampler and rank (in
  pairs, ``scripts.bench.paired``).
- ``keep_bytes_over_file``: the folder's bytes over the bytes of the same rows as
  speculators' file layout (the same tensors in safetensors, no metadata).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench import paired
from scripts.bench.pull.servers import Server, servers
from scripts.bench.pull.shape import REPO, ROW_TOKENS, SPECULATORS_SITE, UDS_SITE

ROWS = int(os.environ.get("KEEP_BENCH_ROWS", "96"))  # train rows: half a rank
WORKERS = int(os.environ.get("KEEP_BENCH_WORKERS", "12"))  # speculators' default
EPOCHS = 3
PAIRS = 3
BACKEND = "kv-hidden-states"


def log(msg: str) -> None:
    print(f"[bench.keep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Rank:
    """One trainer rank's DataLoader (``keep_proc``), an epoch per ``epoch()``; started by
    ``ranks``, which waits for them together."""

    def __init__(
        self, data: Path, backend: str, folder: Path, sampler: str, rank: int, server: Server
    ) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(UDS_SITE), str(REPO), str(SPECULATORS_SITE)]),
            "KV_TEST_OPENAI_UDS": str(server.socket_path),
            "MALLOC_MMAP_THRESHOLD_": str(4 << 20),  # as the pull arms (rows' memory returned)
        }
        args = [str(data), backend, str(folder), str(ROWS), str(WORKERS), sampler, str(rank), "2"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.bench.keep_proc", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=REPO, text=True,
        )  # fmt: skip
        self.name, self.folder = f"{backend} {sampler} rank {rank}", folder
        self.epochs: list[dict[str, Any]] = []
        self.sampler = ""
        self.asked = False  # to quit

    def ready(self) -> None:
        """Until its DataLoader is made (its first line names the sampler)."""
        self.sampler = self._read()["sampler"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} died ({self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def start_epoch(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("epoch\n")
        self.proc.stdin.flush()

    def end_epoch(self) -> dict[str, Any]:
        r = self._read()
        if r["errors"]:
            raise RuntimeError(f"{self.name}: an epoch gave {r}")
        self.epochs.append(r)
        log(f"{self.name}: epoch {r['epoch'] + 1}: {r['rows']} rows in {r['seconds']:.1f} s, "
            f"first batch {r['first_batch_s']:.1f} s, {r['fetched']} fetched")  # fmt: skip
        return r

    def round(self) -> paired.Run:
        self.start_epoch()
        r = self.end_epoch()
        return paired.Run(r["seconds"], r["rows"])

    def quit(self) -> None:
        """Asks it to end (``stop`` waits for it)."""
        if self.proc.poll() is None and not self.asked:
            self.asked = True
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except OSError:
                self.proc.kill()

    def stop(self) -> None:
        self.quit()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def ranks(made: list[Rank]) -> list[Rank]:
    """The ranks, each ready: started together (each imports torch and speculators and
    starts its workers), so their starts overlap. One that fails stops them all."""
    try:
        for r in made:
            r.ready()
    except BaseException:
        stop_all(made)
        raise
    return made


def stop_all(made: list[Rank]) -> None:
    """Ends them together: each is asked first, then waited for."""
    for r in made:
        r.quit()
    for r in made:
        r.stop()


def prompts(server: Server) -> float:
    """The requests vLLM finished so far."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in server.metrics_text().splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def settle(*folders: Path, quiet_s: float = 1.5, limit_s: float = 120.0) -> None:
    """Until no new row file appeared in the folders for ``quiet_s`` (the workers' writers
    keep rows behind the hand-out)."""
    last, since, t0 = -1, time.monotonic(), time.monotonic()
    while time.monotonic() - t0 < limit_s:
        n = sum(len(list(f.glob("hs_*.safetensors"))) for f in folders)
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


def three_epochs(ranks: list[Rank]) -> None:
    """Every rank's epochs, the ranks together (as DDP runs them), the writers settled
    between epochs."""
    for _ in range(EPOCHS):
        for r in ranks:
            r.start_epoch()
        for r in ranks:
            r.end_epoch()
        settle(*(r.folder for r in ranks))


def hit_rate(ranks: list[Rank]) -> float:
    rows = sum(e["rows"] for r in ranks for e in r.epochs[1:EPOCHS])
    fetched = sum(e["fetched"] for r in ranks for e in r.epochs[1:EPOCHS])
    return round(1.0 - float(fetched) / float(rows), 3)


def bytes_over_file(folders: list[Path]) -> float:
    """The folders' row files' bytes over the same tensors saved as speculators' file
    layout (safetensors, no metadata)."""
    from safetensors.torch import load_file, save

    files = [p for f in folders for p in f.glob("hs_*.safetensors")]
    ours = sum(p.stat().st_size for p in files)
    theirs = 0
    for p in files:
        t = load_file(str(p))
        theirs += len(save({"hidden_states": t["hidden_states"], "token_ids": t["token_ids"]}))
    return round(float(ours) / float(theirs), 4)


def main(running: Server | None = None) -> dict[str, Any]:
    """The arm, on its own pull server, or on ``running`` (the pull arms' server: the
    prompts are counted from where it stands)."""
    start = paired.machine_state()
    work = Path(tempfile.mkdtemp(prefix="hs-bench-keep-"))
    out: dict[str, Any] = {"workers": WORKERS, "rows": ROWS, "row_tokens": ROW_TOKENS, "epochs": EPOCHS}
    data = work / "data"
    arm: contextlib.AbstractContextManager[tuple[Server, ...]] = (
        servers(work, "pull") if running is None else contextlib.nullcontext((running,))
    )
    try:
        with arm as (server,):
            # the rank-kept sampler: two ranks, three epochs
            p0 = prompts(server)
            kept = ranks([Rank(data, BACKEND, work / f"keep-{r}", "rank-kept", r, server) for r in (0, 1)])
            try:
                three_epochs(kept)
                out["keep_prompts_over_rows"] = round((prompts(server) - p0) / ROWS, 3)
                out["keep_hit_rate_rank_kept"] = hit_rate(kept)
                first, second = kept[0].epochs[0], kept[0].epochs[1]
                out["keep_first_batch_s"] = round(first["first_batch_s"], 2)
                out["capture_then_train_first_batch_s"] = round(first["seconds"] + second["first_batch_s"], 2)
                out["keep_bytes_over_file"] = bytes_over_file([r.folder for r in kept])
                kept[1].quit()
                # later epochs from the folder, over speculators' file backend on the same folder
                (file0,) = ranks([Rank(data, "file", kept[0].folder, "rank-kept", 0, server)])
                try:
                    pairs = paired.run_pairs(kept[0].round, file0.round, pairs=PAIRS, warmup=1)
                finally:
                    stop_all([*kept, file0])
            except BaseException:
                stop_all(kept)
                raise
            med, rng = pairs.ratio().rounded()
            out["keep_over_file"], out["keep_over_file_range"] = med, rng
            out["keep_rows_per_s"] = round(sum(x.rate for x in pairs.a) / len(pairs.a), 2)
            out["file_rows_per_s"] = round(sum(x.rate for x in pairs.b) / len(pairs.b), 2)
            out["samplers"] = [kept[0].sampler, file0.sampler]
            # speculators' own sampler: two ranks (two nodes' folders), three epochs
            p0 = prompts(server)
            theirs = ranks([Rank(data, BACKEND, work / f"own-{r}", "speculators", r, server) for r in (0, 1)])
            try:
                three_epochs(theirs)
            finally:
                stop_all(theirs)
            out["keep_hit_rate_default_sampler"] = hit_rate(theirs)
            out["keep_prompts_over_rows_default_sampler"] = round((prompts(server) - p0) / ROWS, 3)
            out["default_sampler"] = theirs[0].sampler
            out["epochs_detail"] = {
                "rank_kept": [r.epochs for r in kept],
                "default_sampler": [r.epochs for r in theirs],
                "file": file0.epochs,
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["folder"] = f"local disk ({tempfile.gettempdir()})"
    out["machine_start"], out["machine_end"] = start, paired.machine_state()
    return out


FIGURES = (
    "keep_prompts_over_rows",
    "keep_over_file",
    "keep_first_batch_s",
    "capture_then_train_first_batch_s",
    "keep_bytes_over_file",
    "keep_hit_rate_default_sampler",
)


def figures(out: dict[str, Any]) -> dict[str, Any]:
    """What the summary's last line carries of this arm."""
    return {k: out[k] for k in FIGURES} | {"keep_workers": out["workers"]}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    result = main()
    print(json.dumps(result), flush=True)
    print(json.dumps(figures(result)), flush=True)
