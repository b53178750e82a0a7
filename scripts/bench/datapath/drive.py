"""How the vLLM arms (e: ours, b: vLLM's example connector, ea: the bench's raw connector)
build and feed a harness rank."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from scripts.bench.datapath.shape import BLOCK, LAYERS


def harness_rank(
    model_dir: Path,
    connector_cls: type,
    kv_transfer_config: dict[str, Any],
    num_blocks: int,
    metrics: bool = True,
) -> tuple[Any, Any]:
    """The vLLM worker for ``kv_transfer_config`` (keep it as long as the rank) and a
    harness rank of ``connector_cls`` in every data-path arm's shape, its cache holding
    random GPU-sized states."""
    from scripts.support.vllm_harness import ProducerRank, engine_config, start_worker

    cfg = engine_config(model_dir, LAYERS, kv_transfer_config)
    worker = start_worker(cfg)
    rank = ProducerRank(cfg, connector_cls, num_blocks=num_blocks, block_size=BLOCK, metrics=metrics)
    rank.kv.copy_(torch.randn(rank.kv.shape, dtype=torch.bfloat16))
    return worker, rank


def drive(rank: Any, n_req: int, tokens: int, prefix: str = "q") -> float:
    """Admit requests as blocks free up, step until every one is reported sent."""
    pending = [f"{prefix}{i}" for i in range(n_req)]
    done: set[str] = set()
    prompt = list(range(tokens))
    t0 = time.time()
    while len(done) < n_req:
        admitted = False
        while pending and rank.can_admit(tokens):
            rank.add(pending.pop(0), prompt)
            admitted = True
        finished = rank.step().finished_sending
        done |= finished
        if not admitted and not finished:
            time.sleep(0.0005)  # an idle engine step; a real engine would not spin either
    return t0
