"""HiddenStatesConnector: the vLLM KV connector (a thin facade over the scheduler-side
and worker-side modules) that ships extract_hidden_states outputs to a reader.

Load it with
``--kv-transfer-config '{"kv_connector":"HiddenStatesConnector",
"kv_connector_module_path":"kv_connector.connector","kv_role":"kv_producer",
"kv_connector_extra_config":{"consumer_address":"HOST:PORT"}}'``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kv_connector.producer import modes
from kv_connector.producer.earlier_stage import EarlierStageWorker
from kv_connector.producer.metrics import HiddenStatesConnectorStats, HiddenStatesPromMetrics, build_stats
from kv_connector.producer.options import producer_id_for
from kv_connector.producer.planning import StepPlan
from kv_connector.producer.scheduler_side import SchedulerSide
from kv_connector.producer.startup_checks import check_config, configured_layer_ids
from kv_connector.producer.sync_watch import SyncWatch, Watched, requested
from kv_connector.producer.worker_report import WorkerReport
from kv_connector.producer.worker_side import WorkerSide
from kv_connector.sender.stats import SenderStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class HiddenStatesConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class HiddenStatesWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step (vLLM aggregates the ranks' with ``aggregate``)."""

    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HiddenStatesWorkerMetadata)
        return HiddenStatesWorkerMetadata(report=self.report.merged(other.report))


def use_vllm_logging() -> None:
    """Send the connector's log lines (``kv_connector.*``) through vLLM's handlers, so
    they look like, and go where, vLLM's own do (INFO included)."""
    ours, theirs = logging.getLogger("kv_connector"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


def pipeline_stage() -> tuple[int, int, int] | None:
    """(TP rank, stage, stages) of this worker when its pipeline stage is not the last;
    None on the last stage (or without PP), whose ranks ship."""
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized():
        # a worker side made outside vLLM's workers (tests): no pipeline
        return None
    pp = get_pp_group()
    if pp.is_last_rank:
        return None
    return get_tensor_model_parallel_rank(), pp.rank_in_group, pp.world_size


class HiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Ships each request's captured hidden states to a HiddenStatesReader over NIXL."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        use_vllm_logging()
        self.options, layer_ids = check_config(vllm_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        producer_id = producer_id_for(self.options.producer_id, str(ktc.engine_id))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | EarlierStageWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if (configured := configured_layer_ids(vllm_config)) != layer_ids:
                # by the scheduler only: once per engine, not once per rank
                log.warning(
                    "eagle_aux_hidden_state_layer_ids %s: vLLM captures these layers in increasing "
                    "order, so every sample reports layer_ids=%s (hidden_states[:, i] is layer "
                    "layer_ids[i])",
                    configured,
                    layer_ids,
                )
            self._scheduler = SchedulerSide(
                self.options,
                kv_cache_config,
                producer_id,
                world_size=vllm_config.parallel_config.tensor_parallel_size,
                make_mode=modes.scheduler_mode,
            )
        elif (stage := pipeline_stage()) is not None:
            # a pipeline stage before the last: no captured states, nothing to ship
            self._worker = EarlierStageWorker(*stage)
        else:
            worker = WorkerSide(
                vllm_config,
                self.options,
                producer_id,
                layer_ids,
                kv_cache_config,
                make_mode=modes.worker_mode,
            )
            # KV_CONNECTOR_SYNC_CHECK=1 on a GPU: each hook's host syncs counted (sync_watch)
            self._worker = worker
            if requested():
                self._worker = cast(WorkerSide, Watched(worker, SyncWatch(lambda: worker.rank)))

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.33's sleep mode: ``unregister_kv_caches`` at sleep, ``restore_kv_caches``
        at wake (vLLM 0.32 calls neither)."""
        return True

    def unregister_kv_caches(self) -> None:
        assert self._worker is not None
        self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        assert self._worker is not None
        self._worker.restore_kv_caches()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name, attn_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None
        if isinstance(kv_connector_metadata, HiddenStatesConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata.plan)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        plan = meta.plan if isinstance(meta, HiddenStatesConnectorMetadata) else None
        self._worker.wait_for_save(plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        # with a drafter, vLLM asks this before wait_for_save: the requests this step's plan
        # ships (output tokens, shipped at their finish) are followed already
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        plan = meta.plan if isinstance(meta, HiddenStatesConnectorMetadata) else None
        shipping = {o.request_id for o in plan.ships} if plan is not None else set()
        return self._worker.get_finished(finished_req_ids, shipping), None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        report = self._worker.build_connector_worker_meta()
        return HiddenStatesWorkerMetadata(report=report) if report else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -------------------------------------------------------------- metrics (both roles)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker if self._worker is not None else self._scheduler
        data = side.get_kv_connector_stats() if side is not None else None
        return HiddenStatesConnectorStats(data=dict(data)) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return build_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return HiddenStatesPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ----------------------------------------------------- for scripts and tests
    def sender_stats(self) -> list[SenderStats]:
        """This worker's counters, one snapshot per reader (worker role only)."""
        assert self._worker is not None
        readers = self._worker.readers
        return list(readers.stats()) if readers is not None else []

    def recent_failures(self) -> dict[str, str]:
        """The last failures of this worker: request id -> why (worker role only)."""
        assert self._worker is not None
        return dict(self._worker.recent_failures)

    def wait_connected(self, timeout: float) -> bool:
        """Block until this worker reaches every reader; False after ``timeout`` s."""
        assert self._worker is not None
        return self._worker.wait_connected(timeout)

    # ------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # None: not yet (no worker reaches the request's reader); vLLM asks again next step
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return None

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return HiddenStatesConnectorMetadata(plan=self._scheduler.build_connector_meta(scheduler_output))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        g = self._scheduler.group
        return self.request_finished(request, block_ids[g] if g < len(block_ids) else [])
