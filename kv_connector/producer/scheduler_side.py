"""Scheduler side of the connector: admission, each step's ship plan, finished requests' blocks.

It admits new requests as its delivery mode says and turns each step's SchedulerOutput
into a ship plan. It holds finished requests' blocks until every worker reported them sent.
It tells each finished request where its sample stands, in the words of its delivery mode.
The mode is ``push.mode.PushScheduling`` or ``pull.mode.PullScheduling``, made by ``modes`` once from
the options' ``delivery``."""

from __future__ import annotations

import logging
import queue
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kv_connector.common.errors import ConfigurationError
from kv_connector.producer.delivery import AdmissionKind, DeliveryBook
from kv_connector.producer.idle_steps import IdleSteps, doorbell
from kv_connector.producer.mode import Finished, HandsOutHandles, SchedulerMode, SchedulerModeMaker
from kv_connector.producer.options import ConnectorOptions
from kv_connector.producer.planning import NewRequest, Running, ShipPlanner, StepPlan
from kv_connector.producer.request_table import RequestTable
from kv_connector.producer.step_stats import SchedulerStats, StepData
from kv_connector.producer.worker_report import WorkerReport
from kv_connector.wire.failure import FailureReason
from kv_connector.wire.identity import NO_IDENTITY, IdentityError, identity_of
from kv_connector.wire.outcome import SampleStatus
from kv_connector.wire.protocol import request_id_problem

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

def hidden_state_group(kv_cache_config: KVCacheConfig | None, layer_marker: str = "cache_only_layers") -> int:
    """Index of the KV cache group whose block table addresses the hidden states.

    It is the group that holds the cache-only layer in vLLM's own grouping, found by its spec
    or layer name. On hybrid models with the supplementary-tensor design, it is the
    full-attention group named by ``kv_cache_config.supplementary_group`` (see ``hybrid``).
    """
    if kv_cache_config is None:
        return 0
    supp = getattr(kv_cache_config, "supplementary_group", None)
    if supp is not None:
        return int(supp)
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    found = [
        i
        for i, g in enumerate(groups)
        if isinstance(g.kv_cache_spec, HiddenStateCacheSpec) or any(layer_marker in n for n in g.layer_names)
    ]
    if len(found) == 1:
        return found[0]
    if not found and len(groups) == 1:
        return 0
    raise ConfigurationError(
        f"cannot find the one KV cache group of the hidden states among {len(groups)} groups "
        f"(candidates {found}); is vLLM running the extract_hidden_states method?"
    )


# builds that look for vLLM's input queue before giving up
LOOKS_FOR_INPUT = 3


def engine_input_waits(frame: Any) -> Callable[[], bool] | None:
    """A probe of vLLM's engine core input queue, found on the stack above ``frame``.

    The queue is ``EngineCoreProc.input_queue``, where the input thread puts new requests,
    aborts and shutdowns. The probe is True while something waits there. None where no
    frame's ``self`` has one."""
    while frame is not None:
        q = getattr(frame.f_locals.get("self"), "input_queue", None)
        if isinstance(q, queue.Queue):
            return lambda: not q.empty()
        frame = frame.f_back
    return None


class SchedulerSide:
    def __init__(
        self,
        options: ConnectorOptions,
        kv_cache_config: KVCacheConfig | None,
        producer_id: str,
        world_size: int = 1,
        *,
        make_mode: SchedulerModeMaker,
    ) -> None:
        self.options = options
        self.group = hidden_state_group(kv_cache_config)
        self.producer_id = producer_id
        # one record per request, read and written by both the planner and the book
        self.requests = RequestTable()
        self.book = DeliveryBook(options.connect_timeout_s, table=self.requests)
        # this side's step data for vLLM's metrics
        self.metrics = SchedulerStats()
        self.world_size = world_size
        self.mode: SchedulerMode = make_mode(options, self.book, producer_id, world_size)
        self.planner = ShipPlanner(self.requests, route=self.mode.route)
        self.handles = self.mode if isinstance(self.mode, HandsOutHandles) else None
        # naps before steps that only wait for held samples, ended by the worker side's news
        # (rung from the workers' processes too) or by a new request
        bell = doorbell(producer_id)
        self.idle = IdleSteps(bell=bell)
        if self.mode.hold_nap_s is not None and bell.listen():
            self.idle.hold_s = self.mode.hold_nap_s
        else:
            # nothing would end a long nap early: the short ones only
            self.idle.hold_s = 0.0
        # requests in vLLM that did not finish yet
        self._unfinished: set[str] = set()
        # vLLM's engine has requests to add
        self._input_waits: Callable[[], bool] | None = None
        self._looked_for_input = 0

    def on_new_request(self, request: Request) -> None:
        """Follow a new request.

        A request id that cannot travel, or a bad ``sample_id`` or ``metadata`` in its
        kv_transfer_params, fails it alone: it runs without shipping, and says why."""
        params = request.kv_transfer_params or {}
        include = bool(params.get("include_output_tokens", self.options.include_output_tokens))
        rid = request.request_id
        try:
            identity, bad = identity_of(params), None
        except IdentityError as e:
            identity, bad = NO_IDENTITY, f"invalid kv_transfer_params: {e}"
        self._unfinished.add(rid)
        self.planner.add(rid, include_output=include, identity=identity)
        self.book.add(rid)
        if self.handles is not None:
            self.handles.on_new_request(rid)
        problem = request_id_problem(rid) or bad
        # refused alone, at admission: never its connection
        if problem is not None:
            self.book.refuse(rid, problem)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """May the request start now? Its delivery mode says.

        While it may not, it waits in vLLM's queue holding no blocks (None: vLLM asks again
        next step). It waits at most ``connect_timeout_s``; then it runs without shipping,
        and its kv_transfer_params say why. Nothing is ever loaded from outside (0 tokens,
        synchronously)."""
        rid = request.request_id
        a = self.mode.admit(rid)
        self.metrics.waiting(rid, a.kind is AdmissionKind.WAIT)
        if a.kind is AdmissionKind.WAIT:
            return None, False
        if a.kind is AdmissionKind.FAIL and self.planner.is_tracked(rid):
            log.error("request %s: %s; it runs without shipping its hidden states", rid, a.why)
            self.planner.drop(rid)
            self.metrics.admission_failed(a.failure.reason if a.failure else FailureReason.OTHER)
        return 0, False

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Takes the workers' reports of one step, their ``WorkerReport``s merged by vLLM.

        It also counts the requests whose blocks vLLM frees now: every worker reported them sent."""
        report = getattr(output.kv_connector_worker_meta, "report", None)
        if isinstance(report, WorkerReport):
            self._take_report(report)
        self.metrics.sent(output.finished_sending or ())

    def _take_report(self, report: WorkerReport) -> None:
        self.mode.update(report)
        for rid, failure in self.book.update(report.failures, report.delivered):
            log.error("request %s (already finished) lost its hidden states: %s", rid, failure.why)

    def _engine_input(self) -> Callable[[], bool] | None:
        """Whether vLLM's engine core has requests waiting to be added to its input queue.

        The queue is found once on the call stack of ``build_connector_meta``, the engine
        core's own thread. None where the engine has none to look at (an in-process engine)."""
        if self._input_waits is None and self._looked_for_input < LOOKS_FOR_INPUT:
            self._looked_for_input += 1
            self._input_waits = engine_input_waits(sys._getframe(1))
        return self._input_waits

    def build_connector_meta(self, out: SchedulerOutput) -> StepPlan:
        """This step's plan: what each worker ships, holds or drops (the connector metadata)."""
        # an empty step (vLLM steps on while finished requests hold blocks) naps, or not;
        # long while it only holds samples, if a new request can end the nap
        holding_only = not self._unfinished and self.idle.hold_s > 0 and self._engine_input() is not None
        self.idle.rest(out.total_num_scheduled_tokens, holding_only, self._input_waits)
        g = self.group
        new = [
            NewRequest(
                r.req_id,
                r.prompt_token_ids or [],
                r.block_ids[g] if r.block_ids else [],
                r.num_computed_tokens,
            )
            for r in out.scheduled_new_reqs
        ]
        for n in new:
            if (reader := self.mode.started(n.request_id)) is not None:
                log.info(
                    "request %s started before it was admitted (vLLM does not wait on the connector for "
                    "requests that skip the prefix cache, such as prompt_logprobs ones): its sample goes "
                    "to %s once that reader is connected",
                    n.request_id,
                    reader,
                )
                self.metrics.waiting(n.request_id, False)
        c = out.scheduled_cached_reqs
        active, resumed = self.planner.active, c.resumed_req_ids
        # only a request still followed (active) or resumed can give a slice: a decoding one that
        # shipped its prompt has nothing to plan, and with neither, no row is looked at
        running: list[Running] = []
        if active or resumed:
            rows = zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, strict=False)
            running = [
                (rid, (blocks or ())[g] if blocks else None, rid in resumed, computed)
                for rid, blocks, computed in rows
                if rid in active or rid in resumed
            ]
        plan = self.planner.plan(new, running, out.num_scheduled_tokens, out.preempted_req_ids or ())
        if self.handles is not None:
            plan.news = self.handles.news()
        return plan

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a shipped request until it is sent (push) or released (pull).

        In push the workers report it sent; in pull a consumer releases it. Its
        kv_transfer_params name its sample: the request id, and the sample id (the
        request's own when it gave none). They say where it stands, as its delivery mode
        puts it."""

        rid = request.request_id
        self._unfinished.discard(rid)
        rec = self.requests.get(rid)
        hold = self.planner.finish(rid, list(request.all_token_ids), block_ids)
        self.metrics.waiting(rid, False)
        if hold:
            self.metrics.holding(rid, len(block_ids))
        status, error = self.book.outcome(rid)
        done = Finished(
            request_id=rid,
            identity=rec.identity if rec is not None else NO_IDENTITY,
            hold=hold,
            status=status,
            error=error,
            aborted=getattr(getattr(request, "status", None), "name", "") == "FINISHED_ABORTED",
        )
        # every finish, so the mode forgets the request
        params = self.mode.request_finished(done)
        # its record goes: later reports about it are late
        self.book.finish(rid)
        if not hold and status is not SampleStatus.FAILED:
            # nothing was shipped (e.g. aborted before its prompt ran)
            return False, None
        return hold, params

    def get_kv_connector_stats(self) -> StepData | None:
        """This step's metrics (``step_stats``): admission failures since the last step,
        and the levels of the book when they changed."""
        return self.metrics.take(self.mode.reachable())
