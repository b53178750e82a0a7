"""One trainer rank of ``scripts.bench.keep`` (PYTHONPATH holds speculators):

    python -m scripts.bench.keep_proc DATA BACKEND DIR ROWS WORKERS SAMPLER RANK WORLD

writes the pull arms' dataset of ROWS train rows (``pull.loader_proc``), builds
speculators' own train DataLoader as rank RANK of WORLD with WORKERS workers and the
SAMPLER (``kv_connector.speculators.SamplerKind``): BACKEND ``kv-hidden-states`` keeps
its rows in DIR (``--kv-hs-keep``), ``file`` reads DIR (``--hidden-states-path``). Each
"epoch" line on stdin runs the next epoch (``set_epoch`` first, as speculators' trainer
does) and answers one JSON line: seconds, seconds to the first batch, rows, errors and
the rows the rank's fetch agent fetched from vLLM in it; "quit" ends it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench.pull.loader_proc import _write_dataset
from scripts.bench.pull.shape import HIDDEN, LAYER_IDS, ROW_TOKENS


def _train_loader(
    data: Path, backend: str, keep_dir: str, rows: int, workers: int, sampler: str
) -> tuple[Any, Any]:
    import speculators.train.distributed as dist
    import torch
    from hs_connectors.transfer import HiddenStatesBackend
    from speculators.train.dataloader import create_train_val_loaders

    import kv_connector.speculators as ks

    b = HiddenStatesBackend.registry[backend]
    parser = argparse.ArgumentParser()
    b.add_train_args(parser)
    if backend == "file":
        argv = ["--hidden-states-path", keep_dir]
        ks.use_sampler(sampler)  # the file backend reads no --kv-hs-* flag: the documented call
    else:
        argv = ["--kv-hs-keep", keep_dir, "--kv-hs-sampler", sampler]
    transfer = b.from_train_args(parser.parse_args(argv), str(data))
    train, _val = create_train_val_loaders(
        data_path=str(data), total_seq_len=ROW_TOKENS, hidden_states_dtype=torch.bfloat16,
        transfer=transfer, vllm_endpoint="http://localhost/v1", on_missing="generate",
        verifier_name_or_path=None, request_timeout=120.0, max_retries=2,
        generation_validation_retries=2, max_consecutive_generation_failures=5,
        hidden_size=HIDDEN, num_target_layers=len(LAYER_IDS) - 1, num_workers=workers, prefetch_factor=2,
        preprocess=None, train_data_ratio=(rows + 0.5) / (rows + 1), seed=3,
    )  # fmt: skip
    assert dist.get_dp_size() >= 1
    return train, transfer


def _fetched(transfer: Any) -> int:
    """Rows the rank's fetch agent fetched so far (0 for the file backend)."""
    pulls = getattr(type(transfer), "agent_address", None) is not None
    return int(transfer.client.stats().fetched) if pulls else 0


def _epoch(train: Any, transfer: Any, epoch: int) -> dict[str, Any]:
    train.batch_sampler.set_epoch(epoch)
    before = _fetched(transfer) if epoch > 0 else 0
    got = errors = 0
    first = None
    t0 = time.perf_counter()
    for batch in train:
        if first is None:
            first = time.perf_counter() - t0
        errors += int(batch["error_records"])
        got += int(batch["document_ids"][0].max()) + 1 if batch["input_ids"].numel() else 0
    secs = time.perf_counter() - t0
    return {
        "epoch": epoch,
        "seconds": secs,
        "first_batch_s": first,
        "rows": got,
        "errors": errors,
        "fetched": _fetched(transfer) - before,
    }


def main(a: list[str]) -> int:
    data, backend, keep_dir, rows, workers, sampler = Path(a[0]), a[1], a[2], int(a[3]), int(a[4]), a[5]
    rank, world = int(a[6]), int(a[7])
    import speculators.train.distributed as dist

    dist._dp_size, dist._dp_rank = world, rank  # what speculators' launcher sets on this rank
    if not data.exists():
        _write_dataset(data, rows)
    train, transfer = _train_loader(data, backend, keep_dir, rows, workers, sampler)
    print(json.dumps({"ready": True, "sampler": type(train.batch_sampler).__name__}), flush=True)
    for epoch, line in enumerate(sys.stdin):
        if line.strip() == "quit":
            break
        print(json.dumps(_epoch(train, transfer, epoch)), flush=True)
    return 0


def _exit_on_term(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, _exit_on_term)
    sys.exit(main(sys.argv[1:]))
