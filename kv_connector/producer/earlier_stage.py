"""The worker side on a pipeline stage before the last: it holds no captured states.

vLLM builds the extract_hidden_states drafter and its cache-only layer on the last stage
only (``producer.stages``), so a worker of an earlier stage registers only its own target
layers' caches. It starts no sender, listens nowhere and ships nothing; the last stage's
ranks (TP ranks 0 .. TP-1, as without PP) ship every sample.

vLLM counts a request's finish from every worker of every stage (``KVOutputAggregator``,
one count a worker of ``parallel_config.world_size``) before it frees the request's
blocks. So this side reports each request the scheduler's plans ship as finished as soon
as the scheduler finishes it; the last stage's ranks report theirs once delivered, and the
blocks are freed then, as without PP. A request never shipped (aborted before its last
prompt token) is reported by no worker, as the last stage's ranks do not report it either.
"""

from __future__ import annotations

import logging

import torch

from kv_connector.producer.planning import StepPlan
from kv_connector.producer.worker_report import WorkerReport

log = logging.getLogger("kv_connector.producer")


class EarlierStageWorker:
    """The connector's worker side on pipeline stage ``stage`` (not the last) of ``stages``,
    TP rank ``rank``."""

    readers: None = None

    def __init__(self, rank: int, stage: int, stages: int) -> None:
        self.rank, self.stage, self.stages = rank, stage, stages
        # requests a plan shipped, until the scheduler finishes them
        self._shipped: set[str] = set()
        # the last report: a step's plan read after it (vLLM asks with a drafter) adds none of them
        self._reported: set[str] = set()
        self.recent_failures: dict[str, str] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        log.info(
            "hidden-states connector rank %d, pipeline stage %d of %d: no captured states here "
            "(%d cache layers, none the drafter's); the last stage's ranks ship every sample",
            self.rank,
            self.stage,
            self.stages,
            len(kv_caches),
        )

    def unregister_kv_caches(self) -> None:
        return None

    def restore_kv_caches(self) -> None:
        return None

    def save_kv_layer(self, layer_name: str, attn_metadata: object) -> None:
        return None

    def handle_preemptions(self, plan: StepPlan | None) -> None:
        return None

    def wait_for_save(self, plan: StepPlan | None) -> None:
        if plan is not None and plan.ships:
            self._shipped.update(o.request_id for o in plan.ships if o.request_id not in self._reported)
        self._reported = set()

    def get_finished(self, finished_req_ids: set[str], shipping: set[str] | None = None) -> set[str] | None:
        """The requests finished now that a plan shipped (``shipping``: this step's, asked
        before ``wait_for_save`` when a drafter runs)."""
        if shipping:
            self._shipped |= shipping
        if not finished_req_ids:
            return None
        ready = finished_req_ids & self._shipped
        self._shipped -= ready
        self._reported = ready
        return ready or None

    def build_connector_worker_meta(self) -> WorkerReport:
        return WorkerReport()

    def get_kv_connector_stats(self) -> None:
        return None

    def wait_connected(self, timeout_s: float) -> bool:
        # it reaches no reader: nothing to wait for
        return True

    def shutdown(self) -> None:
        self._shipped.clear()
        self._reported.clear()


__all__ = ["EarlierStageWorker"]
