"""One tensor-parallel rank of a producer, driven with real vLLM objects and no model:

    python -m scripts.support.harness_rank SPEC.json

The spec names the model directory (a config is enough), the captured layer ids, the TP
size and this rank, the gloo rendezvous, the readers, and the requests (id and token
count). Every rank fills its cache-only layer with the same deterministic states
(``sample_states``), as vLLM's replicated states are the same on every rank, and ships
its stripe through HiddenStatesConnector. Prints one JSON line: what finished, where
each sample went, and this rank's bytes and seconds per reader.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch


def sample_states(
    request_id: str, num_tokens: int, num_layers: int, hidden: int, dtype: torch.dtype
) -> torch.Tensor:
    """The deterministic states of a request: [num_tokens, num_layers, hidden]."""
    g = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
    return torch.randn(num_tokens, num_layers, hidden, generator=g).to(dtype)


def sample_tokens(request_id: str, num_tokens: int) -> list[int]:
    h = zlib.crc32(request_id.encode())
    return [(h + 7 * i) % 1000 + 1 for i in range(num_tokens)]


def main(spec: dict[str, Any]) -> dict[str, Any]:
    from kv_connector.connector import HiddenStatesConnector
    from scripts.support.vllm_harness import ProducerRank, engine_config, start_worker

    extra: dict[str, Any] = {
        "consumer_address": spec["readers"],
        "sharding": spec.get("sharding", "request_hash"),
        "producer_id": spec["producer_id"],
        "connect_timeout_s": spec.get("connect_timeout_s", 30.0),
    }
    ktc = {
        "kv_connector": "HiddenStatesConnector",
        "kv_connector_module_path": "kv_connector.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }
    tp, rank = spec.get("tp", 1), spec.get("rank", 0)
    cfg = engine_config(spec["model_dir"], spec["layer_ids"], ktc, dtype=spec.get("dtype", "bfloat16"), tp=tp)
    _vllm_worker = start_worker(cfg, rank, spec.get("init_method"))  # as vLLM's executor starts a rank
    cache: dict[str, torch.Tensor] = {}
    sizes = {r["id"]: r["tokens"] for r in spec["requests"]}

    def fill(rid: str, start: int, n: int) -> torch.Tensor:
        if rid not in cache:
            cache[rid] = sample_states(rid, sizes[rid], len(spec["layer_ids"]), hidden, dtype)
        return cache[rid][start : start + n]

    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg):
        hidden = cfg.model_config.get_hidden_size()
        dtype = cfg.model_config.dtype
        prod = ProducerRank(
            cfg,
            HiddenStatesConnector,
            num_blocks=spec.get("num_blocks", 129),
            fill=fill if spec.get("fill", True) else None,
        )
    if not spec.get("fill", True):  # bandwidth runs: random states written once, not per step
        prod.kv.copy_(
            torch.randn(prod.kv.shape, generator=torch.Generator().manual_seed(rank)).to(prod.kv.dtype)
        )
    # every reachable reader reached, and its link reported to the scheduler side, before
    # the first admission: each harness rank runs its own replica of the scheduler side,
    # and replicas that saw different readers up would route round robin differently (vLLM
    # runs one scheduler for all ranks). A reader that stays gone lets this end at the timeout.
    prod.worker.wait_connected(extra["connect_timeout_s"])
    prod.step()
    if tp > 1:  # start the clock together: a sample completes only when every rank's share landed
        torch.distributed.barrier()
    pending = [(r["id"], r["tokens"]) for r in spec["requests"]]
    done: set[str] = set()
    params: dict[str, Any] = {}
    t0 = time.monotonic()
    deadline = t0 + spec.get("timeout_s", 300.0)
    while len(done) < len(spec["requests"]) and time.monotonic() < deadline:
        admitted = False
        while pending and prod.can_admit(pending[0][1]):
            rid, n = pending.pop(0)
            prod.add(rid, sample_tokens(rid, n))
            admitted = True
        res = prod.step(chunk=spec.get("chunk"))
        params.update(res.kv_transfer_params)
        done |= res.finished_sending
        if not admitted and not res.finished_sending:
            time.sleep(0.001)
    elapsed = time.monotonic() - t0
    per_reader = [
        {"reader": reader, "bytes": st.bytes, "write_s": st.write_s}
        for reader, st in zip(spec["readers"], prod.worker.sender_stats(), strict=True)
    ]
    # a sample fails on the workers (its sender) or at admission (its reader stayed
    # unreachable: it ran without shipping, and only its kv_transfer_params say so)
    failures = {
        rid: p["hidden_states"]["error"]
        for rid, p in params.items()
        if p["hidden_states"]["status"] == "failed"
    }
    failures.update(prod.worker.recent_failures())
    prod.shutdown()
    return {
        "rank": rank,
        "finished": sorted(done),
        "failed": failures,
        "readers_of": {rid: p["hidden_states"]["consumer_address"] for rid, p in params.items()},
        "per_reader": per_reader,
        "bytes": sum(p["bytes"] for p in per_reader),
        "write_s": sum(p["write_s"] for p in per_reader),
        "elapsed_s": elapsed,
    }


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    out = main(json.loads(Path(sys.argv[1]).read_text()))
    print(json.dumps(out), flush=True)
