"""The connector's metrics in vLLM's own path (vLLM adapter): ``HiddenStatesConnectorStats``
carries one step's ``step_stats.StepData`` from the workers and the scheduler side to the
API server, where ``HiddenStatesPromMetrics`` observes it into ``vllm:hidden_states_*``
series beside vLLM's own, with vLLM's labels (``model_name``, ``engine``).

Metrics are made through the classes vLLM hands in (``metric_types``: prometheus_client's,
or Ray's wrappers), and every series exists from the start (the reasons too), at zero.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kv_connector.common.observe import OPERATION_BUCKETS_S, WAIT_BUCKETS_S
from kv_connector.producer import step_stats
from kv_connector.producer.step_stats import (
    COUNTERS,
    FAILED,
    GAUGES,
    HISTOGRAMS,
    Count,
    Level,
    LevelBook,
    Observed,
)
from kv_connector.wire.failure import FailureReason

if TYPE_CHECKING:
    from vllm.config import VllmConfig

BUCKETS = {Observed.WRITE_LATENCY: OPERATION_BUCKETS_S, Observed.CREDIT_WAIT: WAIT_BUCKETS_S}


@dataclass
class HiddenStatesConnectorStats(KVConnectorStats):
    """One step's ``StepData`` (``data``), from one side or merged over several."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict(step_stats.empty())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        # a new object: vLLM may hand the same dict to the log and to Prometheus
        return HiddenStatesConnectorStats(data=dict(step_stats.merge(self.data, other.data)))

    def reduce(self) -> dict[str, int | float]:
        return step_stats.summary(step_stats.merge(self.data, {}))

    def is_empty(self) -> bool:
        return step_stats.is_empty(self.data)


def build_stats(data: dict[str, Any] | None) -> HiddenStatesConnectorStats:
    return HiddenStatesConnectorStats(data=copy.deepcopy(data) if data else {})


class HiddenStatesPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types these as a union of the three; each is the class its key names
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        gauge: Any = self._gauge_cls
        engines = per_engine_labelvalues.items()
        self._counters: dict[Count, dict[int, Any]] = {}
        for kind, spec in COUNTERS.items():
            c = counter(name=spec.name, documentation=spec.doc, labelnames=labelnames)
            self._counters[kind] = {i: c.labels(*v) for i, v in engines}
        failed = counter(name=FAILED.name, documentation=FAILED.doc, labelnames=[*labelnames, "reason"])
        self._failed = {i: {r: failed.labels(*v, r.value) for r in FailureReason} for i, v in engines}
        self._histograms: dict[Observed, dict[int, Any]] = {}
        for obs, spec in HISTOGRAMS.items():
            h = histogram(
                name=spec.name, documentation=spec.doc, buckets=list(BUCKETS[obs]), labelnames=labelnames
            )
            self._histograms[obs] = {i: h.labels(*v) for i, v in engines}
        self._gauges: dict[Level, dict[int, Any]] = {}
        for level, spec in GAUGES.items():
            g = gauge(
                name=spec.name, documentation=spec.doc, multiprocess_mode="mostrecent", labelnames=labelnames
            )
            self._gauges[level] = {i: g.labels(*v) for i, v in engines}
        self._levels = {i: LevelBook() for i in per_engine_labelvalues}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # validated, unknown kinds skipped below
        d = step_stats.merge(transfer_stats_data, {})
        for kind in step_stats.known(Count, d["counts"]):
            self._counters[kind][engine_idx].inc(d["counts"][kind.value])
        for reason in step_stats.known(FailureReason, d["failed"]):
            self._failed[engine_idx][reason].inc(d["failed"][reason.value])
        for obs in step_stats.known(Observed, d["observed"]):
            h = self._histograms[obs][engine_idx]
            for v in d["observed"][obs.value]:
                h.observe(v)
        for level, value in self._levels[engine_idx].update(d["levels"]).items():
            self._gauges[level][engine_idx].set(value)
