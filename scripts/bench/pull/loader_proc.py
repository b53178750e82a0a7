"""The DataLoader process of the loader pairings (PYTHONPATH holds speculators):

    python -m scripts.bench.pull.loader_proc DATA BACKEND HS_DIR ROWS WORKERS FETCH_AGENT POOL_MIB

writes a dataset of ROWS train rows (plus one val row), builds speculators' own
DataLoader on it with WORKERS workers (the pull backend's ``--kv-hs-fetch-agent
FETCH_AGENT``; BACKEND ``manifest-only`` is the pull backend less its data) and answers
"ready", "spawn", "round", "count" and "quit" on stdin, one JSON line each on stdout."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench import paired
from scripts.bench.pull.shape import HIDDEN, LAYER_IDS, NULL_ARM, ROW_TOKENS
from scripts.support.proc_tree import descendants, made_a_nixl_agent, pss_mib, spawned_workers


def _write_dataset(data: Path, rows: int) -> None:
    from datasets import Dataset

    rng = random.Random(11)
    ids = [[rng.randrange(1024) for _ in range(ROW_TOKENS)] for _ in range(rows + 1)]
    masks = [[1] * ROW_TOKENS for _ in ids]
    ds = Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": [ROW_TOKENS] * len(ids)})
    ds.set_format(type="torch")
    ds.save_to_disk(str(data))


def _train_loader(
    data: Path, backend: str, hs_dir: str, rows: int, workers: int, fetch_agent: str, pool_mib: int
) -> tuple[Any, Path]:
    """speculators' train DataLoader with the backend's transfer, timed by
    ``transfer.TimedTransfer`` into a file beside ``data`` (returned with it)."""
    import torch
    from hs_connectors.transfer import HiddenStatesBackend
    from speculators.train.dataloader import create_train_val_loaders

    import kv_connector.speculators  # noqa: F401  registers kv-hidden-states
    from scripts.bench.pull.transfer import ManifestOnly, TimedTransfer

    manifest_only = backend == NULL_ARM  # the pull backend less its data (the ceiling arm)
    b = HiddenStatesBackend.registry["kv-hidden-states" if manifest_only else backend]
    parser = argparse.ArgumentParser()
    b.add_train_args(parser)
    argv = ["--hidden-states-path", hs_dir] if backend == "file" else ["--kv-hs-fetch-agent", fetch_agent]
    if pool_mib and backend != "file":
        argv += ["--kv-hs-pool-mib", str(pool_mib)]
    timings = data.parent / f"{data.name}-timings.txt"
    inner = b.from_train_args(parser.parse_args(argv), str(data))
    transfer = TimedTransfer(ManifestOnly() if manifest_only else inner, timings)
    train, _val = create_train_val_loaders(
        data_path=str(data), total_seq_len=ROW_TOKENS, hidden_states_dtype=torch.bfloat16,
        transfer=transfer, vllm_endpoint="http://localhost/v1", on_missing="generate",
        verifier_name_or_path=None, request_timeout=120.0, max_retries=2,
        generation_validation_retries=2, max_consecutive_generation_failures=5,
        hidden_size=HIDDEN, num_target_layers=len(LAYER_IDS) - 1, num_workers=workers, prefetch_factor=2,
        preprocess=None, train_data_ratio=(rows + 0.5) / (rows + 1),
    )  # fmt: skip
    return train, timings


def _count() -> dict[str, Any]:
    """The processes under this one, and which made a NIXL agent."""
    under = descendants(os.getpid())
    agents = [p for p in [os.getpid(), *under] if made_a_nixl_agent(p)]
    return {
        "pid": os.getpid(),
        "descendants": under,
        "nixl_agent_pids": agents,
        "workers": spawned_workers(under),
        "pss_mib": round(sum(pss_mib(p) for p in [os.getpid(), *under])),
    }


def _round(train: Any, timings: Path, rows: int) -> dict[str, Any]:
    """One epoch of the train split."""
    from scripts.bench.pull.transfer import read_log

    row_bytes = ROW_TOKENS * len(LAYER_IDS) * HIDDEN * 2
    got = errors = 0
    read_log(timings)
    c0, t0 = paired.cpu_seconds(), time.perf_counter()
    for batch in train:
        errors += int(batch["error_records"])
        got += int(batch["document_ids"][0].max()) + 1 if batch["input_ids"].numel() else 0
    secs = time.perf_counter() - t0
    return {
        "seconds": secs,
        "rows": got,
        "expected": rows,
        "errors": errors,
        "bytes": float(got * row_bytes),
        "cpu_s": paired.cpu_seconds() - c0,  # this process only (not its workers)
        "workers_s": read_log(timings),  # summed over the workers
    }


def loader_main(
    data: Path, backend: str, hs_dir: str, rows: int, workers: int, fetch_agent: str, pool_mib: int
) -> int:
    _write_dataset(data, rows)
    train, timings = _train_loader(data, backend, hs_dir, rows, workers, fetch_agent, pool_mib)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            print(json.dumps({"bye": True}), flush=True)
            break
        if cmd == "ready":
            out: dict[str, Any] = {"ready": True}
        elif cmd == "count":
            out = _count()
        elif cmd == "spawn":  # start the (persistent) workers: one batch, the epoch left
            next(iter(train))
            out = {"spawned": True}
        else:
            out = _round(train, timings, rows)
        print(json.dumps(out), flush=True)
    return 0


def _exit_on_term(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # the finally blocks stop every process started


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, _exit_on_term)
    a = sys.argv
    sys.exit(loader_main(Path(a[1]), a[2], a[3], int(a[4]), int(a[5]), a[6], int(a[7])))
