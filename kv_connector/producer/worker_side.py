"""Worker side of the connector: reads each step's slots and hands complete requests to a mode.

It finds the cache-only layer's tensor, reads each step's slot mapping and checks it off
the critical path. Complete requests go to its delivery mode, ``push.mode.PushWorker`` or
``pull.mode.PullWorker``, which ``modes`` makes once from the options' ``delivery``; this
module knows it only by its protocols (``mode``). What the mode settles goes back to vLLM
and the scheduler."""

from __future__ import annotations

import atexit
import collections
import logging
import sys
from typing import TYPE_CHECKING

import torch

from kv_connector.cache.blocks import CacheBlocks
from kv_connector.common.amx import request_amx
from kv_connector.common.errors import ConfigurationError, IntegrityError, KvConnectorError
from kv_connector.producer.engine_bell import doorbell
from kv_connector.producer.fingerprints import Fingerprints
from kv_connector.producer.mode import (
    HoldsSamples,
    RankCache,
    ReleasesCache,
    SendsToReaders,
    WorkerMode,
    WorkerModeMaker,
)
from kv_connector.producer.options import ConnectorOptions, replica_of
from kv_connector.producer.planning import BlockRecorder, ShipOrder, SlotMismatch, StepPlan, in_kernel_blocks
from kv_connector.producer.slot_check import SlotChecks, StepGate
from kv_connector.producer.step_inputs import find_input_ids
from kv_connector.producer.step_stats import StepData, WorkerStats
from kv_connector.producer.worker_report import WorkerReport
from kv_connector.wire.failure import FailureReason, SampleFailure
from kv_connector.wire.layout import BlockLayout, CacheView, layout_from_view
from kv_connector.wire.protocol import ShareChecksum
from kv_connector.wire.provenance import ModelRunner, Provenance

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

CHECKSUM_NAMES = {
    None: "none",
    ShareChecksum.XXH3: "XXH3 of the bytes",
    ShareChecksum.BLOCKS: "block digests",
    ShareChecksum.FINGERPRINT: "fingerprints taken in the step that wrote each slot",
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def provenance_of(vllm_config: VllmConfig) -> Provenance:
    """What this worker's samples say produced them: the vLLM, its model runner and the model.

    The model is named as vLLM was given it. The CPU build runs V1 whatever the config says."""
    import vllm
    from vllm.platforms import current_platform

    v2 = bool(getattr(vllm_config, "use_v2_model_runner", False)) and not current_platform.is_cpu()
    model = vllm_config.model_config
    return Provenance(
        vllm_version=vllm.__version__,
        model_runner=ModelRunner.V2 if v2 else ModelRunner.V1,
        model=str(model.model),
        revision=model.revision or None,
    )


def written_slots(layer_name: str) -> torch.Tensor | None:
    """The slot mapping vLLM's cache update uses for ``layer_name`` this forward, or None.

    It comes from the forward context's per-layer dict."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    mapping = getattr(get_forward_context(), "slot_mapping", None)
    slots = mapping.get(layer_name) if isinstance(mapping, dict) else None
    return slots if isinstance(slots, torch.Tensor) else None


def read_cache(
    cache: torch.Tensor, num_layers: int, hidden_size: int, kv_cache_config: KVCacheConfig | None
) -> CacheView:
    """The cache-only layer's tensor as ``layout.layout_from_view`` reads it.

    The hidden-state group's manager block size and block count come from vLLM's KV cache
    config. The view may be split into kernel blocks; the config says by how much.
    ``layout.AmbiguousCacheView`` where it cannot be read without a guess."""
    from kv_connector.producer.scheduler_side import hidden_state_group

    manager_block_size = num_blocks = None
    if kv_cache_config is not None:
        group = kv_cache_config.kv_cache_groups[hidden_state_group(kv_cache_config)]
        manager_block_size, num_blocks = group.kv_cache_spec.block_size, kv_cache_config.num_blocks
    return layout_from_view(
        cache.shape, cache.stride(), num_layers, hidden_size, manager_block_size, num_blocks
    )


class WorkerSide:
    def __init__(
        self,
        vllm_config: VllmConfig,
        options: ConnectorOptions,
        producer_id: str,
        layer_ids: list[int],
        kv_cache_config: KVCacheConfig | None = None,
        *,
        make_mode: WorkerModeMaker,
    ) -> None:
        # before this worker's first forward, where the vLLM plugin did not run
        request_amx()
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        # the cache tensor's blocks per manager block (vLLM's kernel split)
        self.kernel_blocks = 1
        self.options = options
        self.producer_id = producer_id
        self.layer_ids = layer_ids
        self.layer_name = ""
        # the cache-only layer's tensor (registered)
        self.cache: torch.Tensor | None = None
        self.asleep = False
        self.make_mode = make_mode
        # the delivery mode once the cache is registered, and the optional capabilities it has
        self._mode: WorkerMode | None = None
        self.holds: HoldsSamples | None = None
        self.releases: ReleasesCache | None = None
        self.readers: SendsToReaders | None = None
        self.recorder: BlockRecorder | None = None
        # the fingerprint words each step's slots give (FINGERPRINT records), where the cache is
        self.fingerprints: Fingerprints | None = None
        # the steps' slot mappings, checked off the critical path
        self.checks: SlotChecks | None = None
        self._slots: torch.Tensor | None = None
        # vLLM's buffer of the step's input ids (``step_inputs``), looked for at the first step
        self._input_ids: torch.Tensor | None = None
        self._looked_for_inputs = not options.check_tokens
        self._shipped: set[str] = set()
        self._failed: dict[str, str] = {}
        self._done: set[str] = set()
        self._finished_by_scheduler: set[str] = set()
        # the last failures, for logs and tests (request id -> why); bounded
        self.recent_failures: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.rank = 0
        # for the scheduler (see build_connector_worker_meta): news since the last report
        self._report_failures: dict[str, SampleFailure] = {}
        self._report_delivered: set[str] = set()
        # this rank's step data for vLLM's metrics
        self.metrics = WorkerStats(self.rank)

    @property
    def mode(self) -> WorkerMode | None:
        return self._mode

    @mode.setter
    def mode(self, mode: WorkerMode | None) -> None:
        """The delivery mode, asked once for its capabilities (``mode``)."""
        self._mode = mode
        self.holds = mode if isinstance(mode, HoldsSamples) else None
        self.releases = mode if isinstance(mode, ReleasesCache) else None
        self.readers = mode if isinstance(mode, SendsToReaders) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Find the cache-only layer's tensor, read its blocks' layout, and start the mode.

        In three steps: the layer (exactly one), its layout (``read_cache``; padded blocks
        are logged), and the step path's parts and the delivery mode on this rank."""
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.layer_name = self._cache_only_layer(kv_caches)
        self.cache = cache = kv_caches[self.layer_name]
        layout = self._layout(cache)
        self.rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        checksum = self.options.checksum.resolve(cache.is_cuda, layout)
        self.metrics = WorkerStats(self.rank)
        self.recorder = BlockRecorder(layout.block_size)
        self.checks = SlotChecks(layout.block_size)
        if checksum is ShareChecksum.FINGERPRINT:
            self.fingerprints = Fingerprints(CacheBlocks(cache, layout), layout.block_size)
        atexit.register(self.shutdown)
        self.mode = self.make_mode(
            self.options,
            RankCache(
                cache=cache,
                layout=layout,
                layer_ids=self.layer_ids,
                producer_id=self.producer_id,
                rank=self.rank,
                world_size=world,
                checksum=checksum,
                # ends the scheduler side's nap, in any process
                news=doorbell(self.producer_id).ring,
                provenance=provenance_of(self.vllm_config),
                replica=self._replica(),
            ),
        )
        log.info(
            "hidden-states connector rank %d/%d: layer %s, %d blocks of %d tokens (%d a manager block; "
            "%s, %s, %d bytes), checksum: %s, %s",
            self.rank,
            world,
            self.layer_name,
            cache.shape[0],
            layout.block_size,
            self.kernel_blocks,
            layout.layout,
            layout.dtype,
            layout.block_bytes,
            CHECKSUM_NAMES[checksum],
            self.mode.describe(),
        )

    def _replica(self) -> int:
        """This engine's data-parallel replica, named by vLLM's engine id (0 without replicas)."""
        ktc = getattr(self.vllm_config, "kv_transfer_config", None)
        return replica_of(str(getattr(ktc, "engine_id", ""))) or 0

    def _cache_only_layer(self, kv_caches: dict[str, torch.Tensor]) -> str:
        """The name of the one cache-only layer among ``kv_caches`` (ConfigurationError: not one)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = get_layers_from_vllm_config(self.vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) != 1:
            raise ConfigurationError(
                f"HiddenStatesConnector needs exactly one cache-only layer, found {len(layers)}: "
                "start vLLM with the extract_hidden_states speculative method"
            )
        return next(iter(layers))

    def _layout(self, cache: torch.Tensor) -> BlockLayout:
        """The layout of the cache-only layer's blocks, and its kernel split (``kernel_blocks``).

        Padded blocks are logged with their share of padding."""
        hidden = self.vllm_config.model_config.get_hidden_size()
        num_layers = len(self.layer_ids)
        try:
            view = read_cache(cache, num_layers, hidden, self.kv_cache_config)
        except ValueError as e:
            raise ConfigurationError(
                f"HiddenStatesConnector cannot read layer {self.layer_name}'s cache: {e}"
            ) from None
        self.kernel_blocks = view.kernel_blocks
        layout = BlockLayout(
            view.layout,
            view.block_size,
            num_layers,
            hidden,
            _dtype_name(cache.dtype),  # type: ignore[arg-type]
        )
        if view.padded(num_layers, hidden):
            pitch = view.block_pitch * cache.element_size()
            log.warning(
                "the cache-only layer's blocks of %d tokens (%d bytes) lie %d bytes apart (vLLM pads its "
                "KV cache group's page to the other groups'): each block is one descriptor of its own, "
                "and %.1f%% of its memory is padding",
                view.block_size,
                layout.block_bytes,
                pitch,
                100 * (1 - layout.block_bytes / pitch),
            )
        return layout

    def save_kv_layer(self, layer_name: str, attn_metadata: object) -> None:
        """Keep the slot mapping the cache-only layer wrote with.

        That is the forward context's for the layer, which vLLM's cache update reads; else
        its attention metadata's."""
        if layer_name == self.layer_name:
            slots = written_slots(layer_name)
            if slots is None:
                slots = getattr(attn_metadata, "slot_mapping", None)
            if isinstance(slots, torch.Tensor):
                self._slots = slots

    def wait_for_save(self, plan: StepPlan | None) -> None:
        """After the step's drafter: hand the step's slot mapping to the checks, then ship.

        In four steps: begin (the plan in the cache's blocks; the mode's news, resets), check (the
        step's slots against the plan), gate (each complete request's blocks and its check)
        and ship. On a GPU the checks take an asynchronous copy and an event, so the engine
        never waits for the device. Each complete request is held by its sender until the
        step is done and checked (``slot_check``). In pull mode they are held for consumers."""
        slots, self._slots = self._slots, None
        if not plan or self.recorder is None or self.checks is None or self.mode is None:
            return
        if not self._looked_for_inputs:
            self._find_step_inputs(sys._getframe(1))
        plan = self._begin(plan)
        gate, errors = self._check(plan, slots)
        for rid, why in errors.items():
            self._fail_unshipped(rid, why)
        self._ship(self._gate(plan.ships, gate), gate)

    def _begin(self, plan: StepPlan) -> StepPlan:
        """The plan in the cache tensor's blocks; holds the scheduler ended and requests
        started anew are forgotten."""
        plan = in_kernel_blocks(plan, self.kernel_blocks)
        if plan.news is not None and self.holds is not None:
            self.holds.hear(plan.news)
        for rid in plan.resets:
            self._forget(rid)
        return plan

    def _check(self, plan: StepPlan, slots: torch.Tensor | None) -> tuple[StepGate | None, dict[str, str]]:
        """The step's check, queued, and the requests that already failed one (request id ->
        why): this step's on the host now, or an earlier step's on a GPU."""
        assert self.recorder is not None and self.checks is not None
        errors: dict[str, str] = {}
        gate: StepGate | None = None
        if plan.slices and slots is None:
            errors = {sl.request_id: "the cache-only layer wrote no slots this step" for sl in plan.slices}
        elif plan.slices or plan.ships:
            planned, errors = self.recorder.slots_of(plan.slices)
            if self.fingerprints is not None:
                # the words of the slots this step wrote, now (knowing the last of those that ship);
                # a failure fails the step's requests by name, never the engine's step
                try:
                    self.fingerprints.take(planned, {o.request_id: len(o.token_ids) - 1 for o in plan.ships})
                except Exception as e:
                    log.exception("fingerprints of this step's slots could not be taken")
                    errors.update({sl.request_id: f"fingerprints not taken: {e}" for sl in plan.slices})
            gate = self.checks.add(slots if plan.slices else None, planned, self._input_ids)
        errors.update(self.checks.settle())
        return gate, errors

    def _gate(
        self, ships: list[ShipOrder], gate: StepGate | None
    ) -> list[tuple[ShipOrder, list[int], bool]]:
        """The complete requests that may ship: each with its blocks, and whether its slots'
        check is done. One that failed is refused."""
        assert self.recorder is not None and self.checks is not None
        ready: list[tuple[ShipOrder, list[int], bool]] = []
        for order in ships:
            rid = order.request_id
            if rid in self._failed:
                self._refuse(order, self._failed[rid])
                continue
            try:
                blocks = self.recorder.ship_blocks(len(order.token_ids), order.block_ids)
                if gate is not None and self._input_ids is not None:
                    self.checks.compare_tokens(rid, order.token_ids, gate.seq)
                done, wrong = gate.poll(rid) if gate is not None else (True, None)
                if wrong is not None:
                    raise SlotMismatch(wrong)
                ready.append((order, blocks, done))
            except (SlotMismatch, ValueError) as e:
                self._cannot_ship(order, e)
        return ready

    def _ship(self, ready: list[tuple[ShipOrder, list[int], bool]], gate: StepGate | None) -> None:
        """Each request to its mode, with the fingerprint words it still needs (one gather
        for the step)."""
        assert self.mode is not None
        fp = self.fingerprints
        words = fp.ship_many([(o.request_id, len(o.token_ids), b) for o, b, _ in ready]) if fp else {}
        for order, blocks, done in ready:
            rid = order.request_id
            try:
                taken = words.get(rid)
                if isinstance(taken, Exception):
                    raise IntegrityError(f"fingerprints not taken: {taken}") from taken
                told_finished = rid in self._finished_by_scheduler
                self.mode.ship(order, blocks, None if done else gate, told_finished, taken)
                self._shipped.add(rid)
                self.metrics.shipped()
            except (ValueError, KvConnectorError) as e:
                self._cannot_ship(order, e)
            self._forget(rid)

    def _refuse(self, order: ShipOrder, why: str) -> None:
        """The request will not ship: a consumer that asks for it is told ``why``."""
        if self.holds is not None:
            self.holds.refuse(order, why)
        self._done.add(order.request_id)

    def _find_step_inputs(self, frame: object) -> None:
        """vLLM's buffer of the step's input ids for the token check (``check_tokens``),
        looked for once on the stack above ``frame``."""
        self._looked_for_inputs = True
        self._input_ids = find_input_ids(frame)
        if self._input_ids is None:
            log.warning(
                "rank %d: vLLM's model runner keeps no input ids where this connector looks "
                "(input_ids.gpu, input_buffers.input_ids): samples' token ids are not checked "
                "against the tokens their states were computed from",
                self.rank,
            )
        else:
            log.info("rank %d: token check on (each sample's token ids against the forward's input ids)",
                     self.rank)

    def _cannot_ship(self, order: ShipOrder, error: Exception) -> None:
        rid = order.request_id
        log.error("request %s cannot be shipped: %s", rid, error)
        self._failed[rid] = str(error)
        self._note_failure(rid, SampleFailure(FailureReason.OTHER, str(error)))
        self._refuse(order, str(error))
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        """What the step path keeps of a request it no longer follows (its blocks, its words)."""
        if self.recorder is not None:
            self.recorder.forget(rid)
        if self.fingerprints is not None:
            self.fingerprints.forget(rid)

    def _fail_unshipped(self, rid: str, why: str) -> None:
        """A slice of the request was not written where its block table says, or not at all.

        It will not be shipped. One already shipped in push is failed by its sender, which
        reports it; its gate says why. One already held in pull is failed here: its hold
        ends, and a consumer is told why."""
        if rid in self._failed:
            return
        if rid in self._shipped:
            if self.holds is not None and self.holds.fail_held(rid, why):
                log.error("request %s: %s; its held hidden states will not be served", rid, why)
                self._failed[rid] = why
                self._note_failure(rid, SampleFailure(FailureReason.OTHER, why))
            return
        log.error("request %s: %s; its hidden states will not be shipped", rid, why)
        self._failed[rid] = why
        self._note_failure(rid, SampleFailure(FailureReason.OTHER, why))

    def unregister_kv_caches(self) -> None:
        """vLLM goes to sleep and releases the cache's memory: the mode stops reading it.

        In push mode, shares in flight get up to ``drain_timeout_s`` to be acknowledged; the
        rest fail by name, and the cache is deregistered. Nothing reads the cache until
        ``restore_kv_caches``. Idempotent."""
        if self.asleep or self.releases is None:
            # a mode that does not release the cache keeps serving from its registration
            return
        why = (
            "vLLM went to sleep before the reader acknowledged it (sleep mode releases the cache "
            "holding its hidden states)"
        )
        self.releases.sleep(why, self.options.drain_timeout_s)
        self.asleep = True

    def restore_kv_caches(self) -> None:
        """vLLM woke up: the mode reads the cache again. Idempotent.

        Its memory may have moved, so push registers it again and reconnects to every reader."""
        if not self.asleep or self.cache is None or self.releases is None:
            return
        self.releases.wake(self.cache)
        if self.fingerprints is not None:
            self.fingerprints.blocks.rebind(self.cache)
        self.asleep = False
        log.info("rank %d: awake; the cache is registered again", self.rank)

    def handle_preemptions(self, plan: StepPlan | None) -> None:
        """Called before this step reuses preempted requests' blocks.

        A shipped request's share gets up to ``preempt_timeout_s`` to be safely written:
        granted, landed, hashed. One that is not by then fails, and the reader drops it.
        Nothing is ever shipped from reused blocks, and a full or hung reader holds the step
        no longer."""
        if plan is None or not plan.preempted or self.mode is None:
            return
        for rid in plan.preempted:
            self._forget(rid)
        for rid, failure in self.mode.preempt(plan.preempted, self._shipped).items():
            self._failed[rid] = failure.why
            self._note_failure(rid, failure)

    def get_finished(self, finished_req_ids: set[str], shipping: set[str] | None = None) -> set[str] | None:
        """``shipping``: the requests this step's plan ships and ``wait_for_save`` has not yet.

        vLLM asks this first when a drafter runs. A request that ships its output tokens is
        shipped in the step that also tells the workers it finished."""
        mode = self.mode
        if mode is None:
            return None
        # only requests this worker shipped or failed, or ships this step, wait for their
        # finish here; the rest (never shipped: aborted, or failed at admission) must not pile up
        if self.checks is not None:
            for rid, why in self.checks.settle().items():
                self._fail_unshipped(rid, why)
        # a step's few finished, looked up: not a union of every shipped one
        if finished_req_ids:
            shipped, done, now = self._shipped, self._done, shipping or set()
            followed = {rid for rid in finished_req_ids if rid in shipped or rid in done or rid in now}
            self._finished_by_scheduler |= followed
            for rid in finished_req_ids - followed:
                self._failed.pop(rid, None)
                self._forget(rid)
                if self.checks is not None:
                    self.checks.forget(rid)
            if self.holds is not None:
                self.holds.finished(finished_req_ids & shipped)
        settled = mode.settle()
        self._done |= settled.done
        self._report_delivered |= settled.delivered
        for rid, failure in settled.failed.items():
            self._failed[rid] = failure.why
            self._note_failure(rid, failure)
        ready = self._done & self._finished_by_scheduler
        if not ready:
            return None
        self._done -= ready
        self._finished_by_scheduler -= ready
        self._shipped -= ready
        for rid in ready:
            self._failed.pop(rid, None)
            if self.checks is not None:
                self.checks.forget(rid)
        return ready

    def build_connector_worker_meta(self) -> WorkerReport:
        """What the scheduler side should learn this step.

        It carries changes of this rank's link to each reader (None: connected), and the
        requests failed or delivered since."""
        links, news = self.mode.link_changes() if self.mode is not None else ([], [])
        failures, self._report_failures = self._report_failures, {}
        delivered, self._report_delivered = self._report_delivered, set()
        return WorkerReport(links, failures, delivered, news)

    def wait_connected(self, timeout_s: float) -> bool:
        """Until this rank reaches every reader its mode sends to; False after ``timeout_s``.

        A mode that sends to no reader (pull: consumers come to it) is connected once it runs."""
        if self.readers is not None:
            return self.readers.wait_connected(timeout_s)
        return self.mode is not None

    def get_kv_connector_stats(self) -> StepData | None:
        """This step's metrics (``step_stats``).

        They hold the senders' counters and observations since the last step. On rank 0
        they also hold the samples shipped, delivered and failed."""

        return self.metrics.take_from(self.readers.metrics_sources() if self.readers is not None else [])

    def _note_failure(self, rid: str, failure: SampleFailure) -> None:
        self.metrics.failed(failure.reason)
        self._report_failures[rid] = failure
        self.recent_failures[rid] = failure.why
        while len(self.recent_failures) > 1000:
            self.recent_failures.popitem(last=False)

    def shutdown(self) -> None:
        mode, self.mode = self.mode, None
        if mode is not None:
            mode.close(self.options.drain_timeout_s)
