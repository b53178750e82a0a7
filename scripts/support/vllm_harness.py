"""Drive a KV connector with real vLLM objects and no model compute.

A ``ProducerRank`` holds a real ``VllmConfig`` (built by vLLM's ``EngineArgs`` from a
config-only model directory), a real ``CacheOnlyAttentionLayer`` whose cache tensor is
allocated in vLLM's CPU layout, and the connector's scheduler-side and worker-side
instances. ``step`` builds a real ``SchedulerOutput``, lets the scheduler side turn it
into connector metadata, fills the cache the way the layer fills it (vLLM's own
``basic_cache`` at the step's slot mapping), and runs the worker side's per-step hooks
in the order the model runner calls them. Used by the benchmark and the multi-node tests.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def config_only_model(
    out: str | os.PathLike[str], hidden_size: int, num_layers: int = 4, **extra: Any
) -> Path:
    """A Llama config.json with no weights: enough for vLLM to build its config."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    heads = max(1, hidden_size // 128)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "vocab_size": 1024,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        **extra,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def engine_config(
    model_dir: str | os.PathLike[str],
    layer_ids: Sequence[int],
    kv_transfer_config: dict[str, Any] | None,
    dtype: str = "bfloat16",
    tp: int = 1,
    max_model_len: int = 8192,
    pp: int = 1,
) -> Any:
    """vLLM's own VllmConfig for an extract_hidden_states producer (no engine started)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype=dtype,  # type: ignore[arg-type]
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        kv_transfer_config=kv_transfer_config,  # type: ignore[arg-type]  # vLLM accepts the dict
        distributed_executor_backend="mp" if tp * pp > 1 else None,
    )
    return args.create_engine_config()


def file_store_init_method(directory: str | os.PathLike[str] | None = None) -> str:
    """A rendezvous for the ranks of one producer, as vLLM's own executor makes it
    (``get_file_store_init_method``): a file, so no port is picked and released."""
    import tempfile
    import uuid

    base = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    return f"file://{base / f'vllm_dist_{uuid.uuid4().hex}'}"


def start_worker(vllm_config: Any, rank: int = 0, init_method: str | None = None) -> Any:
    """Start this process's rank the way vLLM's multiprocess executor starts a worker
    (``WorkerProc.__init__``): the platform's worker class through vLLM's
    ``WorkerWrapperBase``, then ``init_device()``, which prepares what the platform
    needs (on CPU: ``VLLM_DIST_IDENT`` for the shared-memory communicator, the gloo
    process group, the tensor-parallel groups). The model is not loaded. Returns the
    wrapper (keep it alive while the rank runs)."""
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    if model_parallel_is_initialized():
        raise RuntimeError("this process already runs a vLLM rank")
    world = vllm_config.parallel_config.world_size
    kwargs: list[dict[str, Any]] = [{} for _ in range(world)]
    kwargs[rank] = {
        "vllm_config": vllm_config,
        "local_rank": rank,
        "rank": rank,
        "distributed_init_method": init_method or file_store_init_method(),
        "is_driver_worker": rank == 0,
    }
    wrapper = WorkerWrapperBase(rpc_rank=rank, global_rank=rank)
    wrapper.init_worker(kwargs)
    wrapper.init_device()
    return wrapper


@dataclass
class _Req:
    request: Any
    block_ids: list[int]
    num_tokens: int
    computed: int = 0
    finished: bool = False


@dataclass
class StepResult:
    finished_sending: set[str] = field(default_factory=set)
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)


class ProducerRank:
    """One rank of a producer: scheduler-side and worker-side connector, a real
    cache-only layer and its cache tensor ([num_blocks, L, block_size, H], vLLM's CPU
    layout), and a free list of blocks."""

    def __init__(
        self,
        vllm_config: Any,
        connector_cls: type,
        num_blocks: int,
        block_size: int = 128,
        fill: Callable[[str, int, int], torch.Tensor] | None = None,
        zero: bool = True,
        metrics: bool = True,
    ) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
        from vllm.v1.kv_cache_interface import (
            HiddenStateCacheSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )

        self.config = vllm_config
        spec_cfg = vllm_config.speculative_config.draft_model_config.hf_config
        self.layer_ids = list(spec_cfg.eagle_aux_hidden_state_layer_ids)
        self.num_layers = len(self.layer_ids)
        self.hidden = vllm_config.model_config.get_hidden_size()
        self.dtype = vllm_config.model_config.dtype
        self.block_size = block_size
        n_target = vllm_config.model_config.get_total_num_hidden_layers()
        self.layer_name = f"model.cache_only_layers.{n_target}"
        static = vllm_config.compilation_config.static_forward_context
        if self.layer_name not in static:
            with set_current_vllm_config(vllm_config):
                CacheOnlyAttentionLayer(self.num_layers, self.hidden, prefix=self.layer_name)
        self.layer = static[self.layer_name]
        shape = (num_blocks, self.num_layers, block_size, self.hidden)
        # zero=False: memory the test never reads stays untouched (a large cache costs nothing)
        self.kv = torch.zeros(shape, dtype=self.dtype) if zero else torch.empty(shape, dtype=self.dtype)
        self.layer.kv_cache = self.kv
        spec = HiddenStateCacheSpec(
            block_size=block_size, num_kv_heads=self.num_layers, head_size=self.hidden, dtype=self.dtype
        )
        kv_cfg = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=self.kv.numel() * self.kv.element_size(),
                    layers=[self.layer_name],
                    layer_stride=0,
                    block_stride=self.kv.stride(0) * self.kv.element_size(),
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec([self.layer_name], spec)],
        )
        self.world_size = vllm_config.parallel_config.world_size
        self.scheduler = connector_cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cfg)
        self.worker = connector_cls(vllm_config, KVConnectorRole.WORKER, kv_cfg)
        self.worker.register_kv_caches({self.layer_name: self.kv})
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 is vLLM's null block
        self.reqs: dict[str, _Req] = {}
        self._finished_last_step: set[str] = set()
        self._carried: list[StepResult] = []
        self.fill = fill
        # take the connector's stats every step on both roles, as vLLM does (its metrics on)
        self.metrics = metrics
        self.steps_with_stats = 0

    def can_admit(self, num_tokens: int) -> bool:
        return len(self.free) >= -(-num_tokens // self.block_size)

    def add(self, request_id: str, token_ids: list[int], max_tokens: int = 1) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        n_blocks = -(-len(token_ids) // self.block_size)
        if len(self.free) < n_blocks:
            raise RuntimeError("no free blocks")
        blocks = [self.free.pop() for _ in range(n_blocks)]
        req = Request(request_id, list(token_ids), SamplingParams(max_tokens=max_tokens), None)
        self.scheduler.on_new_request(req)
        # admission, as vLLM's scheduler asks before it allocates: None until the workers
        # reported a working link to the request's reader (steps carry their reports)
        deadline = time.monotonic() + 60
        while self.scheduler.get_num_new_matched_tokens(req, 0)[0] is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{request_id} not admitted within 60 s")
            # steps taken while this request waits finish others: keep what they said
            self._carried.append(self.step())
            time.sleep(0.005)
        self.reqs[request_id] = _Req(req, blocks, len(token_ids))

    def _as_every_rank(self, meta: Any) -> Any:
        """This rank's report as its scheduler side would get it from vLLM, which merges
        every rank's: in TP each harness rank runs its own replica of the scheduler side and
        sees only its own worker, so its link changes stand for every rank's (the ranks are
        alike and all reach the same readers); without this a TP scheduler waits for links
        of ranks it never hears from, and admits nothing."""
        world = self.world_size
        report = getattr(meta, "report", None)
        if world > 1 and report is not None and report.links:
            report.links = [
                type(link)(link.reader, r, link.error) for link in report.links for r in range(world)
            ]
        return meta

    def step(self, chunk: int | None = None) -> StepResult:
        """One engine step: schedule up to ``chunk`` tokens of each unfinished request,
        build and bind the metadata, write the states, run the worker hooks, finish the
        requests whose prompt completed and free blocks the connector released."""
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionMetadata, basic_cache
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput

        out = SchedulerOutput.make_empty()
        out.finished_req_ids = self._finished_last_step
        cached = CachedRequestData.make_empty()
        slots: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        for rid, r in self.reqs.items():
            if r.finished:
                continue
            n = r.num_tokens - r.computed if chunk is None else min(chunk, r.num_tokens - r.computed)
            if r.computed == 0:
                out.scheduled_new_reqs.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_token_ids=r.request.prompt_token_ids,
                        mm_features=[],
                        sampling_params=r.request.sampling_params,
                        pooling_params=None,
                        block_ids=(list(r.block_ids),),
                        num_computed_tokens=0,
                        lora_request=None,
                    )
                )
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(None)
                cached.num_computed_tokens.append(r.computed)
                cached.num_output_tokens.append(0)
            out.num_scheduled_tokens[rid] = n
            pos = torch.arange(r.computed, r.computed + n)
            blocks = torch.tensor(r.block_ids)[pos // self.block_size]
            slots.append(blocks * self.block_size + pos % self.block_size)
            if self.fill is not None:
                states.append(self.fill(rid, r.computed, n))
            r.computed += n
        out.scheduled_cached_reqs = cached
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        meta = self.scheduler.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        if slots:
            slot_mapping = torch.cat(slots)
            if states:
                basic_cache(torch.cat(states), self.kv, slot_mapping)
            self.worker.save_kv_layer(self.layer_name, self.kv, CacheOnlyAttentionMetadata(slot_mapping))
        self.worker.wait_for_save()
        sent, _ = self.worker.get_finished(set(out.finished_req_ids))
        stats = self.worker.get_kv_connector_stats() if self.metrics else None
        report = KVConnectorOutput(
            finished_sending=set(sent or ()) or None,
            kv_connector_worker_meta=self._as_every_rank(self.worker.build_connector_worker_meta()),
        )
        self.worker.clear_connector_metadata()
        result = StepResult(finished_sending=set(sent or ()))
        self._finished_last_step = set()
        self.scheduler.update_connector_output(report)  # as vLLM does after the step
        if self.metrics:
            sched_stats = self.scheduler.get_kv_connector_stats()
            self.steps_with_stats += stats is not None or sched_stats is not None
        for rid, r in self.reqs.items():
            if not r.finished and r.computed >= r.num_tokens:
                r.finished = True
                r.request.append_output_token_ids(0)
                hold, params = self.scheduler.request_finished(r.request, list(r.block_ids))
                self._finished_last_step.add(rid)
                if params:
                    result.kv_transfer_params[rid] = params
                if not hold:
                    result.finished_sending.add(rid)
        for rid in result.finished_sending:
            r2 = self.reqs.pop(rid, None)
            if r2 is not None:
                self.free.extend(r2.block_ids)
        for earlier in self._carried:  # steps taken inside add(), reported with this one
            result.finished_sending |= earlier.finished_sending
            result.kv_transfer_params = {**earlier.kv_transfer_params, **result.kv_transfer_params}
        self._carried.clear()
        return result

    def shutdown(self) -> None:
        self.worker.shutdown()
