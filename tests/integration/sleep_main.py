"""Sleep and wake around transfers, in one process of its own: a real HiddenStatesReader
(NIXL, its own agent) and one producer rank driven with real vLLM objects
(``scripts.support.vllm_harness``), whose connector is called as vLLM 0.33's worker calls it at
sleep (``unregister_kv_caches``) and wake (``restore_kv_caches``). Between the two the
cache's memory is remapped (the tensor's storage moves to a new address, as sleep mode may
map it) and the old memory is overwritten (freed memory reused), so a WRITE or a checksum that
still read it would deliver garbage. Prints one JSON line.

    python tests/integration/sleep_main.py MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

LAYER_IDS = [1, 2]
BLOCK = 16
TOKENS = {"a0": 40, "b0": 33, "c0": 50, "d0": 17, "e0": 64}
DRAIN_S = 3.0


def main(model_dir: str) -> dict[str, Any]:
    from vllm.config import set_current_vllm_config

    from kv_connector.connector import HiddenStatesConnector
    from kv_connector.reader import HiddenStatesReader
    from scripts.support.harness_rank import sample_states, sample_tokens
    from scripts.support.vllm_harness import ProducerRank, engine_config, start_worker

    out: dict[str, Any] = {"events": []}
    taken: dict[str, torch.Tensor] = {}
    held: list[Any] = []  # samples the trainer keeps on lease (their pages stay taken)
    consume = threading.Event()
    idle = threading.Event()  # the consumer is not taking samples
    stop = threading.Event()
    # a pool of 4 pages (blocks of 16 tokens x 2 layers x 128 x bf16: 8 KiB): a held a0
    # (3 pages) leaves b0 (3 pages) without a grant until it is released
    with HiddenStatesReader(pool_bytes=4 * BLOCK * len(LAYER_IDS) * 128 * 2) as reader:

        def consumer() -> None:  # the trainer: takes (and so acknowledges) samples while consume is set
            while not stop.is_set():
                if not consume.is_set():
                    idle.set()
                    consume.wait(0.05)
                    continue
                idle.clear()
                try:
                    s = reader.get(timeout=0.1)
                except TimeoutError:
                    continue
                taken[s.request_id] = s.hidden_states.clone()
                if s.request_id == "a0":
                    held.append(s.keep())
                else:
                    s.release()

        t = threading.Thread(target=consumer, daemon=True)
        t.start()
        ktc = {
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"consumer_address": reader.address, "drain_timeout_s": DRAIN_S},
        }
        cfg = engine_config(model_dir, LAYER_IDS, ktc, dtype="bfloat16")
        _worker = start_worker(cfg)
        hidden, dtype = cfg.model_config.get_hidden_size(), cfg.model_config.dtype
        states = {rid: sample_states(rid, n, len(LAYER_IDS), hidden, dtype) for rid, n in TOKENS.items()}

        def fill(rid: str, start: int, n: int) -> torch.Tensor:
            return states[rid][start : start + n]

        with set_current_vllm_config(cfg):
            prod = ProducerRank(cfg, HiddenStatesConnector, num_blocks=64, block_size=BLOCK, fill=fill)
        assert prod.worker.wait_connected(30)
        done: set[str] = set()

        def ship(rid: str) -> None:  # one step computes the whole prompt and ships it
            prod.add(rid, sample_tokens(rid, TOKENS[rid]))
            done.update(prod.step().finished_sending)

        def step_until(rids: set[str], timeout: float = 30.0) -> None:
            deadline = time.monotonic() + timeout
            while not rids <= done and time.monotonic() < deadline:
                done.update(prod.step().finished_sending)
                time.sleep(0.002)
            assert rids <= done, (rids, done)

        def sleep_and_wake(move: bool) -> float:
            t0 = time.monotonic()
            prod.worker.unregister_kv_caches()  # vLLM 0.33's worker, before releasing the memory
            slept = time.monotonic() - t0
            prod.worker.unregister_kv_caches()  # idempotent
            if move:  # the memory comes back elsewhere; the old bytes become garbage
                old = prod.kv.untyped_storage()
                fresh = torch.empty_like(prod.kv)
                fresh.copy_(prod.kv)
                prod.kv.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
                torch.empty(0, dtype=torch.uint8).set_(old).fill_(0x7F)
                out["moved"] = fresh.data_ptr() != old.data_ptr()
            prod.worker.restore_kv_caches()  # vLLM 0.33's worker, after mapping the memory again
            prod.worker.restore_kv_caches()  # idempotent
            assert prod.worker.wait_connected(30)
            return slept

        consume.set()
        ship("a0")
        step_until({"a0"})
        # b0: shipped while the trainer holds a0, so the reader has no pages to grant it
        ship("b0")
        time.sleep(0.2)  # its credit request reaches the reader
        out["first_sleep_s"] = sleep_and_wake(move=True)
        held.pop().release()
        ship("c0")
        step_until({"b0", "c0"})
        # d0: shipped just before the second sleep, while the trainer takes samples
        ship("d0")
        out["second_sleep_s"] = sleep_and_wake(move=False)
        ship("e0")
        step_until({"d0", "e0"})
        deadline = time.monotonic() + 10
        while not {"c0", "e0"} <= set(taken) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # room for a late b0, which must never come
        stop.set()
        t.join(timeout=5)
        out["failures"] = prod.worker.recent_failures()
        out["reconnects"] = [s.reconnects for s in prod.worker.sender_stats()]
        out["taken"] = sorted(taken)
        out["exact"] = {
            rid: bool(torch.equal(taken[rid].view(torch.uint8), states[rid].view(torch.uint8)))
            for rid in taken
        }
        prod.shutdown()
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    print(json.dumps(main(sys.argv[1])), flush=True)
