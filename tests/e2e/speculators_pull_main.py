"""speculators' side of tests/e2e/test_speculators_pull.py, in a process of its own whose
PYTHONPATH holds speculators (``.venv/speculators-site-packages``):

    speculators_pull_main.py DATA_DIR ENDPOINT OUT_FILE [NUM_WORKERS [FETCH_AGENT]]

registers our backend by importing ``kv_connector.speculators`` (twice: harmless), builds
its transfer as speculators' trainer does (``add_train_args``, ``from_train_args``), and
runs speculators' own ``create_train_val_loaders(..., on_missing="generate",
num_workers=NUM_WORKERS)`` (default 2; ``--kv-hs-fetch-agent FETCH_AGENT``, default
rank) against the vLLM server at ENDPOINT: every batch of both loaders, each row cut out
of its packed batch by its document id. What each row got (its tokens, the auxiliary and
the verifier's last states) goes to OUT_FILE (safetensors, keyed by the row's index in
the dataset), and a JSON line to stdout, with what made NIXL agents while the workers
were alive: the processes under this one that mapped NIXL's UCX plugin, and the rank's
fetch agent's own counts.

With ``KV_TEST_KEEP=DIR`` the trainer keeps its rows there (``--kv-hs-keep``) and runs
``KV_TEST_EPOCHS`` epochs (default 1) of the train loader, pausing a moment between them
(the workers' writers keep rows behind the hand-out): the report says how many rows the
agent fetched by the end of each epoch and how many rows of a later epoch differ from
the first's, and speculators' own file backend (``FileTransfer``) reads every row from
DIR, compared with the first epoch's. ``KV_TEST_SAMPLER`` passes ``--kv-hs-sampler``; the
report names the train loader's batch sampler.

With ``KV_TEST_THEN_WORKER=1``, after that report it reads a line from stdin; on
"worker" it runs both loaders again, with one DataLoader worker and its own client
(``--kv-hs-fetch-agent worker``, no keep), writes their rows to OUT_FILE with the suffix
``.worker.safetensors`` and prints a second JSON line: the rows, the errors and the
processes other than the rank's agent that mapped NIXL's UCX plugin.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TOTAL_SEQ_LEN = 2048
HIDDEN = 128


def collect(train: Any, val: Any, index: dict[tuple[int, ...], int], tensors: dict[str, Any]) -> int:
    """Every row of both loaders into ``tensors`` (by its index in the dataset); the
    rows the loaders could not get."""
    errors = 0
    for loader in (train, val):
        for batch in loader:
            errors += int(batch["error_records"])
            docs = batch["document_ids"][0]
            for d in range(int(docs.max()) + 1):
                at = docs == d
                ids = batch["input_ids"][0][at]
                i = index[tuple(ids.tolist())]  # KeyError: tokens that are no row's
                tensors[f"{i}.input_ids"] = ids.clone()
                tensors[f"{i}.hidden_states"] = batch["hidden_states"][0][at].clone()
                tensors[f"{i}.verifier_last_hidden_states"] = batch["verifier_last_hidden_states"][0][
                    at
                ].clone()
    return errors


def loaders(data_dir: Path, endpoint: str, transfer: Any, num_workers: int) -> tuple[Any, Any]:
    """speculators' own train and validation loaders over ``transfer``."""
    import torch
    from speculators.train.dataloader import create_train_val_loaders

    train, val = create_train_val_loaders(
        data_path=str(data_dir), total_seq_len=TOTAL_SEQ_LEN, hidden_states_dtype=torch.float32,
        transfer=transfer, vllm_endpoint=endpoint, on_missing="generate", verifier_name_or_path=None,
        request_timeout=120.0, max_retries=2, generation_validation_retries=2,
        max_consecutive_generation_failures=5, hidden_size=HIDDEN, num_target_layers=3,
        num_workers=num_workers, prefetch_factor=2, preprocess=None, train_data_ratio=0.75,
    )  # fmt: skip
    return train, val


def transfer_of(backend: Any, data_dir: Path, argv: list[str]) -> Any:
    """The backend's transfer, built as speculators' trainer builds it."""
    parser = argparse.ArgumentParser()
    backend.add_train_args(parser)
    backend.add_train_args(parser)  # the trainer and a launcher may both add them
    args = parser.parse_args(argv)
    if verifier := os.environ.get("KV_TEST_VERIFIER"):  # what speculators' own parser would set
        args.verifier_name_or_path, args.target_layer_ids = verifier, [1, 2]
    transfer = backend.from_train_args(args, str(data_dir))
    assert transfer.expect is not None or not verifier
    return transfer


def main() -> int:
    data_dir, endpoint, out_file = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    num_workers = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    mode = sys.argv[5] if len(sys.argv) > 5 else "rank"
    import torch
    from datasets import load_from_disk
    from hs_connectors.transfer import HiddenStatesBackend
    from safetensors.torch import save_file

    importlib.import_module("kv_connector.speculators")
    importlib.reload(importlib.import_module("kv_connector.speculators"))  # imported twice: harmless
    backend = HiddenStatesBackend.registry["kv-hidden-states"]
    argv = ["--kv-hs-pool-mib", "16", "--kv-hs-fetch-agent", mode]
    keep = os.environ.get("KV_TEST_KEEP")
    epochs = int(os.environ.get("KV_TEST_EPOCHS", "1"))
    if keep:
        argv += ["--kv-hs-keep", keep]
    if sampler := os.environ.get("KV_TEST_SAMPLER"):
        argv += ["--kv-hs-sampler", sampler]
    transfer = transfer_of(backend, data_dir, argv)
    train, val = loaders(data_dir, endpoint, transfer, num_workers)
    rows = load_from_disk(str(data_dir))
    index = {tuple(r["input_ids"].tolist()): i for i, r in enumerate(rows)}
    tensors: dict[str, torch.Tensor] = {}
    errors = 0
    fetched_by_epoch: list[int] = []
    differ = 0
    for epoch in range(1, epochs):  # the train loader's earlier epochs, against the last one's rows
        seen: dict[str, torch.Tensor] = {}
        for batch in train:
            errors += int(batch["error_records"])
            docs = batch["document_ids"][0]
            for d in range(int(docs.max()) + 1):
                at = docs == d
                i = index[tuple(batch["input_ids"][0][at].tolist())]
                seen[f"{i}.hidden_states"] = batch["hidden_states"][0][at].clone()
        fetched_by_epoch.append(transfer.client.stats().fetched)
        if epoch == 1:
            first = seen
        else:
            differ += sum(not torch.equal(first[k], v) for k, v in seen.items())
        time.sleep(2.0)  # the workers' writers keep the last rows
    errors += collect(train, val, index, tensors)
    from scripts.support.proc_tree import descendants, made_a_nixl_agent

    under = descendants(os.getpid())  # the persistent workers are alive still, and the agent
    agents = [p for p in [os.getpid(), *under] if made_a_nixl_agent(p)]
    stats = transfer.client.stats() if mode == "rank" else None
    if epochs > 1:
        fetched_by_epoch.append(stats.fetched if stats is not None else -1)
        differ += sum(not torch.equal(first[k], tensors[k]) for k in first)
    from_file = None
    if keep:
        from hs_connectors.transfer import FileTransfer

        time.sleep(2.0)  # the workers' writers keep the last rows
        theirs = FileTransfer(Path(keep))
        from_file = 0
        for i in sorted({int(k.split(".")[0]) for k in tensors}):
            got = theirs.get_cached(i)
            if got is not None and got["token_ids"].tolist() == tensors[f"{i}.input_ids"].tolist():
                aux = got["hidden_states"][:, :-1].flatten(1).to(tensors[f"{i}.hidden_states"].dtype)
                from_file += int(torch.equal(aux, tensors[f"{i}.hidden_states"]))
    save_file(tensors, str(out_file))
    report = {
        "rows": sorted({int(k.split(".")[0]) for k in tensors}),
        "errors": errors,
        "processes": len(under),
        "fetched_by_epoch": fetched_by_epoch,
        "later_epochs_differ": differ,
        "rows_from_keep_files": from_file,
        "sampler": type(train.batch_sampler).__name__,
        "nixl_agent_pids": agents,
        "agent": None
        if stats is None
        else {
            "pid": stats.pid,
            "name": stats.agent_name,
            "registered_bytes": stats.registered_bytes,
            "fetched": stats.fetched,
            "leases_held": stats.leases_held,
        },
    }
    print(json.dumps(report), flush=True)
    if os.environ.get("KV_TEST_THEN_WORKER") and sys.stdin.readline().strip() == "worker":
        # a client per DataLoader worker (no keep): every row fetched by the workers' own agents
        worker = transfer_of(backend, data_dir, ["--kv-hs-pool-mib", "16", "--kv-hs-fetch-agent", "worker"])
        # one worker a loader: its own agent (two workers' agents are the pull bench's count)
        train, val = loaders(data_dir, endpoint, worker, 1)
        got: dict[str, torch.Tensor] = {}
        errors = collect(train, val, index, got)
        rank_agent = stats.pid if stats is not None else None
        under = descendants(os.getpid())
        agents = [p for p in under if p != rank_agent and made_a_nixl_agent(p)]
        save_file(got, str(out_file.with_suffix(".worker.safetensors")))
        rows = sorted({int(k.split(".")[0]) for k in got})
        print(json.dumps({"rows": rows, "errors": errors, "nixl_agent_pids": agents}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
