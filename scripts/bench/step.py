"""The connector's own cost per engine step, at 256 requests decoding with
``include_output_tokens`` (so every step has a slice of every request), at a short and a
long context: the scheduler side building the step's metadata, the worker side's hooks
(bind, the cache-only layer's slot mapping, wait_for_save, get_finished, the metrics'
step stats on both roles, the report), and the metadata's size as vLLM ships it to the
workers (pickled).

Real vLLM objects (``SchedulerOutput``, ``CacheOnlyAttentionMetadata``) and the real
connector, no model compute. The requests start with their context computed (as after a
prefix-cache hit), so the first step carries their whole block tables once; the
measured steps are the decode steps after it.

``engine_thread_us`` (``scripts.bench.hook_time``): the CPU time each hook spends on the
thread that calls it, per step, medians: at 256 decoding requests with and without
output tokens (``decode_256_output_tokens``, ``decode_256``), and per thousand prefill
tokens (``prefill_per_1k_tokens``: 16 prompts of 1,024 tokens into a reader that takes
every sample, e's harness and steps); beside the bench's raw connector's in the same
harness (``raw``: it ships a prompt's blocks when its prefill ends; measured at prefill).
``engine.metadata_pickle`` is vLLM's pickling of our metadata for its workers. The
timer's own cost (``timer_ns`` a call, measured on an empty hook) is taken off each
hook's figure.
"""

from __future__ import annotations

import os
import pickle
import statistics
import time
from typing import Any

import torch

LAYERS = [1]
HIDDEN = 128
BLOCK = 128


def measure(context: int, n_req: int = 256, steps: int = 30, output_tokens: bool = True) -> dict[str, Any]:
    from scripts.bench.hook_time import HookTimes

    rank, tables, _worker = _start(context, n_req, steps, output_tokens)
    stats_s: list[float] = []
    hooks = HookTimes()
    hooks.wrap(rank.scheduler, "scheduler")
    hooks.wrap(rank.worker, "worker")

    def step(first: bool, pos: int) -> tuple[float, int]:
        out, slots = _schedule(tables, first, pos, context, steps)
        return _timed_step(rank, out, slots, stats_s, hooks)

    step(True, context - 1)  # the prompt's last token: a request ships its prompt here
    hooks.take()
    times, sizes, per_step = [], [], []
    for k in range(steps):
        dt, size = step(False, context + 1 + k)
        times.append(dt)
        sizes.append(size)
        per_step.append(hooks.take())
    rank.shutdown()
    return {
        "step_ms": statistics.median(times) * 1e3,
        "metadata_bytes": statistics.median(sizes),
        "stats_us": statistics.median(stats_s[1:]) * 1e6,  # both roles' stats, in step_ms
        "engine_thread_us": medians_us(per_step),
        "timer_ns": hooks.timer_ns,
    }


def medians_us(per_step: list[dict[str, int]]) -> dict[str, float]:
    """Each hook's median thread CPU time over the steps, and the median of the steps'
    totals, in microseconds."""
    keys = sorted({k for step in per_step for k in step})
    out = {k: round(statistics.median(step.get(k, 0) for step in per_step) / 1e3, 1) for k in keys}
    out["total"] = round(statistics.median(sum(step.values()) for step in per_step) / 1e3, 1)
    return out


def _start(
    context: int, n_req: int, steps: int, output_tokens: bool = True
) -> tuple[Any, dict[str, list[int]], Any]:
    """A harness rank with the real connector, ``n_req`` requests known to its scheduler
    side, and their block tables; and vLLM's worker, which must outlive the measurement."""
    import tempfile
    from pathlib import Path

    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kv_connector.connector import HiddenStatesConnector
    from scripts.support.vllm_harness import ProducerRank, config_only_model, engine_config, start_worker

    model = config_only_model(Path(tempfile.mkdtemp()) / "m", HIDDEN, num_layers=2)
    blocks_per_req = -(-(context + steps + 1) // BLOCK)
    num_blocks = n_req * blocks_per_req + 1
    ktc = {
        "kv_connector": "HiddenStatesConnector",
        "kv_connector_module_path": "kv_connector.connector",
        "kv_role": "kv_producer",
        # nothing listens there: the connector is measured, not the transfer
        "kv_connector_extra_config": {
            "consumer_address": "127.0.0.1:9",
            "include_output_tokens": output_tokens,
        },
    }
    cfg = engine_config(model, LAYERS, ktc, max_model_len=context + steps + 8)
    worker = start_worker(cfg)
    rank = ProducerRank(cfg, HiddenStatesConnector, num_blocks=num_blocks, block_size=BLOCK, zero=False)
    tables = {
        f"r{i}": list(range(1 + i * blocks_per_req, 1 + (i + 1) * blocks_per_req)) for i in range(n_req)
    }
    for rid in tables:
        req = Request(rid, [1] * context, SamplingParams(max_tokens=steps + 2), None)
        rank.scheduler.on_new_request(req)
    return rank, tables, worker


def _schedule(
    tables: dict[str, list[int]], first: bool, pos: int, context: int, steps: int
) -> tuple[Any, torch.Tensor]:
    """The step's ``SchedulerOutput`` (one token of every request, at ``pos``: the first step
    carries the requests new, with their whole block tables, the others cached) and the
    cache slot of each request's token."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    cached = CachedRequestData.make_empty()
    for rid, table in tables.items():
        if first:
            out.scheduled_new_reqs.append(
                NewRequestData(
                    req_id=rid, prompt_token_ids=[1] * context, mm_features=[],
                    sampling_params=SamplingParams(max_tokens=steps + 2), pooling_params=None,
                    block_ids=(list(table),), num_computed_tokens=pos, lora_request=None,
                )
            )  # fmt: skip
        else:
            cached.req_ids.append(rid)
            cached.new_block_ids.append(None)
            cached.num_computed_tokens.append(pos)
            cached.num_output_tokens.append(pos - context)
        out.num_scheduled_tokens[rid] = 1
    out.scheduled_cached_reqs = cached
    out.total_num_scheduled_tokens = len(tables)
    slots = torch.tensor([t[pos // BLOCK] * BLOCK + pos % BLOCK for t in tables.values()])
    return out, slots


def _timed_step(
    rank: Any, out: Any, slots: torch.Tensor, stats_s: list[float], hooks: Any = None
) -> tuple[float, int]:
    """One engine step of the connector's hooks on both sides, timed, and its metadata's
    size as vLLM ships it (pickled); both roles' stats, taken every step as vLLM does, are
    timed apart into ``stats_s`` (and counted in the step's time too)."""
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionMetadata
    from vllm.v1.outputs import KVConnectorOutput

    sched, worker = rank.scheduler, rank.worker
    t0 = time.perf_counter()
    meta = sched.build_connector_meta(out)
    p0 = time.thread_time_ns()
    size = len(pickle.dumps(meta))
    if hooks is not None:
        hooks.add("engine.metadata_pickle", time.thread_time_ns() - p0)
    worker.bind_connector_metadata(meta)
    worker.save_kv_layer(rank.layer_name, rank.kv, CacheOnlyAttentionMetadata(slots))
    worker.wait_for_save()
    worker.get_finished(set())
    t1 = time.perf_counter()
    worker.get_kv_connector_stats()  # vLLM takes both roles' stats every step
    dt = time.perf_counter() - t1
    report = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
    t1 = time.perf_counter()
    sched.get_kv_connector_stats()
    stats_s.append(dt + time.perf_counter() - t1)
    return time.perf_counter() - t0, size


PREFILL_PROMPTS, PREFILL_TOKENS, PREFILL_HIDDEN = 16, 1024, 256


def prefill(raw: bool, rounds: int = 3) -> dict[str, float]:
    """Engine-thread microseconds per thousand prefill tokens, each hook's median over
    ``rounds`` rounds of ``PREFILL_PROMPTS`` prompts: our connector into a reader that takes
    every sample (e's arm), or the bench's raw connector into its raw target (ea's)."""
    import shutil
    import tempfile
    from pathlib import Path

    from scripts.bench.datapath.shape import BLOCK, LAYERS
    from scripts.bench.hook_time import HookTimes
    from scripts.support.vllm_harness import config_only_model

    work = Path(tempfile.mkdtemp(prefix="hs-bench-prefill-"))
    model = config_only_model(work / "m", PREFILL_HIDDEN, num_layers=4)
    nb = -(-PREFILL_TOKENS // BLOCK)
    num_blocks, pool = 4 * nb + 1, 4 * nb * BLOCK * len(LAYERS) * PREFILL_HIDDEN * 2
    arm: Any
    if raw:
        from scripts.bench.datapath.raw_engine import RawEngineArm

        arm = RawEngineArm(model, PREFILL_PROMPTS, PREFILL_TOKENS, num_blocks, pool, PREFILL_HIDDEN)
    else:
        from scripts.bench.datapath.ours import OursArm

        arm = OursArm(model, PREFILL_PROMPTS, PREFILL_TOKENS, num_blocks, pool)
    hooks = HookTimes()
    hooks.wrap(arm.rank.scheduler, "scheduler")
    hooks.wrap(arm.rank.worker, "worker")
    per_round = []
    try:
        for _ in range(rounds):
            hooks.take()
            arm.round()
            per_round.append(hooks.take())
    finally:
        arm.close()
        shutil.rmtree(work, ignore_errors=True)
    thousands = PREFILL_PROMPTS * PREFILL_TOKENS / 1000
    return medians_us([{k: round(v / thousands) for k, v in r.items()} for r in per_round])


def main() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for context in (2048, 32768):
        out[f"ctx_{context}"] = in_process(measure, context)
    ours = {
        "decode_256_output_tokens": out["ctx_2048"]["engine_thread_us"],
        "decode_256": in_process(measure, 2048, output_tokens=False)["engine_thread_us"],
        "prefill_per_1k_tokens": in_process(prefill, False),
    }
    # the raw connector ships at a prompt's end only; its decode steps are not measured
    ours["raw"] = {"prefill_per_1k_tokens": in_process(prefill, True)}
    out["engine_thread_us"] = ours
    return out


def in_process(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a spawned process of its own (one thread for torch; the
    harness runs one vLLM rank a process); its error raised here, with its traceback."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_run, args=(b, fn, args, kwargs))
    p.start()
    b.close()
    try:
        ok, result = a.recv()
    except EOFError:
        ok, result = False, f"the process died (exit status {p.exitcode})"
    p.join(60)
    if not ok:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed: {result}")
    return result


def _run(conn: Any, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    import traceback

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        conn.send((False, traceback.format_exc()[-3000:]))
        raise
    conn.send((True, result))


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=1))
