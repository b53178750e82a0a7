"""The step barrier, end to end in one process of its own: a real HiddenStatesReader and
one producer rank driven with real vLLM objects (``scripts.support.vllm_harness``), whose steps
"run on a device" that stays busy until this script lets it (the host stand-in of the
step's CUDA event says "not done" meanwhile). While it is busy, nothing of a shipped
request may be read: no credit request, no checksum, no WRITE; once it is done the sample
goes out. A request whose slot mapping disagrees with its block table, found only once its
step is done (after it was shipped), fails by name and never reaches the reader. Prints
one JSON line.

    python tests/integration/barrier_main.py MODEL_DIR
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
TOKENS = {"a0": 40, "b0": 33, "c0": 20}


def main(model_dir: str) -> dict[str, Any]:
    from vllm.config import set_current_vllm_config

    from kv_connector.connector import HiddenStatesConnector
    from kv_connector.producer import slot_check
    from kv_connector.reader import HiddenStatesReader
    from scripts.support.harness_rank import sample_states, sample_tokens
    from scripts.support.vllm_harness import ProducerRank, engine_config, start_worker

    busy = threading.Event()  # the device is still running the step
    slot_check.HostDone.query = lambda self: not busy.is_set()  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    taken: dict[str, torch.Tensor] = {}
    stop = threading.Event()
    with HiddenStatesReader() as reader:

        def consumer() -> None:
            while not stop.is_set():
                try:
                    s = reader.get(timeout=0.05, copy=True)
                except TimeoutError:
                    continue
                taken[s.request_id] = s.hidden_states.clone()

        t = threading.Thread(target=consumer, daemon=True)
        t.start()
        ktc = {
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"consumer_address": reader.address},
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

        def step_until(rids: set[str], timeout: float = 30.0) -> None:
            deadline = time.monotonic() + timeout
            while not rids <= done and time.monotonic() < deadline:
                done.update(prod.step().finished_sending)
                time.sleep(0.002)
            assert rids <= done, (rids, done)

        def while_busy(rid: str) -> dict[str, Any]:
            """Ship ``rid`` in a step the device has not finished; look a while later."""
            busy.set()
            bytes0 = prod.worker.sender_stats()[0].bytes
            prod.add(rid, sample_tokens(rid, TOKENS[rid]))
            t0 = time.monotonic()
            done.update(prod.step().finished_sending)
            step_s = time.monotonic() - t0
            for _ in range(20):  # later steps (the engine goes on) while the device is busy
                done.update(prod.step().finished_sending)
                time.sleep(0.01)
            st = prod.worker.sender_stats()[0]
            seen = {
                "step_s": step_s,
                "taken": rid in taken,
                "bytes": st.bytes - bytes0,
                "finished": rid in done,
            }
            busy.clear()
            return seen

        out["a0_busy"] = while_busy("a0")
        step_until({"a0"})
        # b0: its slots are written one off where the block table puts them
        real_save = prod.worker.save_kv_layer

        def save_one_off(name: str, kv: torch.Tensor, meta: Any, **kw: Any) -> None:
            meta.slot_mapping = meta.slot_mapping + 1
            real_save(name, kv, meta, **kw)

        prod.worker.save_kv_layer = save_one_off  # type: ignore[method-assign]
        out["b0_busy"] = while_busy("b0")
        prod.worker.save_kv_layer = real_save  # type: ignore[method-assign]
        step_until({"b0"})
        prod.add("c0", sample_tokens("c0", TOKENS["c0"]))
        step_until({"c0"})
        deadline = time.monotonic() + 10
        while not {"a0", "c0"} <= set(taken) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        stop.set()
        t.join(timeout=5)
        out["failures"] = prod.worker.recent_failures()
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
