"""Worker side of the connector: registers the cache-only layer's tensor with NIXL, reads
each step's slot mapping, and hands complete requests to the sender."""

from __future__ import annotations

import atexit
import collections
import logging
import time
from typing import TYPE_CHECKING

import torch

from kv_connector.producer.options import PULL_ENDPOINTS, ConnectorOptions, pull_endpoint
from kv_connector.producer.planning import BlockRecorder, ShipOrder, SlotMismatch, StepPlan
from kv_connector.producer.pull_server import PullServer
from kv_connector.producer.slot_check import SlotChecks, StepGate
from kv_connector.producer.step_stats import StepData, WorkerStats
from kv_connector.producer.worker_report import LinkChange, WorkerReport
from kv_connector.sender.loop import SenderError
from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
from kv_connector.sender.stats import SenderStats
from kv_connector.wire.failure import FailureReason, SampleFailure
from kv_connector.wire.layout import BlockLayout, layout_from_view
from kv_connector.wire.protocol import ShareChecksum

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

CHECKSUM_NAMES = {
    None: "none",
    ShareChecksum.XXH3: "XXH3 of the bytes",
    ShareChecksum.BLOCKS: "block digests",
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WorkerSide:
    def __init__(
        self, vllm_config: VllmConfig, options: ConnectorOptions, producer_id: str, layer_ids: list[int]
    ) -> None:
        self.vllm_config = vllm_config
        self.options = options
        self.producer_id = producer_id
        self.layer_ids = layer_ids
        self.layer_name = ""
        self.cache: torch.Tensor | None = None  # the cache-only layer's tensor (registered)
        self.asleep = False
        self.senders: list[HiddenStatesSender] = []
        self.pull: PullServer | None = None  # pull delivery: this rank's endpoint, instead of senders
        self.recorder: BlockRecorder | None = None
        self.checks: SlotChecks | None = None  # the steps' slot mappings, checked off the critical path
        self._slots: torch.Tensor | None = None
        self._shipped: set[str] = set()
        self._failed: dict[str, str] = {}
        self._done: set[str] = set()
        self._finished_by_scheduler: set[str] = set()
        # the last failures, for logs and tests (request id -> why); bounded
        self.recent_failures: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.rank = 0
        # for the scheduler (see take_report): link states as last reported, and news
        self._reported_links: dict[str, str | None] = {}  # reader -> its last reported error
        self._report_failures: dict[str, SampleFailure] = {}
        self._report_delivered: set[str] = set()
        self.metrics = WorkerStats(self.rank)  # this rank's step data for vLLM's metrics

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = get_layers_from_vllm_config(self.vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) != 1:
            raise ValueError(
                f"HiddenStatesConnector needs exactly one cache-only layer, found {len(layers)}: "
                "start vLLM with the extract_hidden_states speculative method"
            )
        self.layer_name = next(iter(layers))
        self.cache = cache = kv_caches[self.layer_name]
        hidden = self.vllm_config.model_config.get_hidden_size()
        view = layout_from_view(cache.shape, cache.stride(), len(self.layer_ids), hidden)
        layout, block_size = view.layout, view.block_size
        block_layout = BlockLayout(
            layout,
            block_size,
            len(self.layer_ids),
            hidden,
            _dtype_name(cache.dtype),  # type: ignore[arg-type]
        )
        rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.rank = rank
        share_checksum = self.options.checksum.resolve(cache.is_cuda, block_layout)
        checksum = CHECKSUM_NAMES[share_checksum]
        self.metrics = WorkerStats(rank)
        self.recorder = BlockRecorder(block_size)
        self.checks = SlotChecks(block_size)
        atexit.register(self.shutdown)
        if view.padded(len(self.layer_ids), hidden):
            log.warning(
                "the cache-only layer's blocks of %d tokens (%d bytes) lie %d bytes apart (vLLM pads its "
                "KV cache group's page to the other groups'): each block is one descriptor of its own, "
                "and %.1f%% of its memory is padding",
                block_size,
                block_layout.block_bytes,
                view.block_pitch * cache.element_size(),
                100 * (1 - block_layout.block_bytes / (view.block_pitch * cache.element_size())),
            )
        if self.options.pull:
            self.pull = PullServer(
                cache,
                block_layout,
                self.layer_ids,
                self.producer_id,
                rank,
                world,
                pull_endpoint(self.options.pull_listen, rank),
                self.options.pull_timeout_s,
                checksum=share_checksum,
            )
            log.info(
                "hidden-states connector rank %d/%d: layer %s, %d blocks of %d tokens (%s, %s, %d bytes), "
                "checksum: %s, pull delivery: serving at %s, samples held up to %.0f s",
                rank,
                world,
                self.layer_name,
                cache.shape[0],
                block_size,
                layout,
                block_layout.dtype,
                block_layout.block_bytes,
                checksum,
                self.pull.address,
                self.options.pull_timeout_s,
            )
            return
        self.senders = [
            HiddenStatesSender(
                SenderConfig(
                    consumer_address=address,
                    producer_id=self.producer_id,
                    rank=rank,
                    world_size=world,
                    connect_timeout_s=self.options.connect_timeout_s,
                    checksum=share_checksum,
                    sample_timeout_s=self.options.sample_timeout_s,
                ),
                cache,
                block_layout,
                self.layer_ids,
            )
            for address in self.options.readers
        ]
        log.info(
            "hidden-states connector rank %d/%d: layer %s, %d blocks of %d tokens (%s, %s, %d bytes), "
            "checksum: %s, shipping to %s",
            rank,
            world,
            self.layer_name,
            cache.shape[0],
            block_size,
            layout,
            block_layout.dtype,
            block_layout.block_bytes,
            checksum,
            ", ".join(self.options.readers),
        )

    def save_kv_layer(self, layer_name: str, attn_metadata: object) -> None:
        if layer_name == self.layer_name:
            slots = getattr(attn_metadata, "slot_mapping", None)
            if isinstance(slots, torch.Tensor):
                self._slots = slots

    def wait_for_save(self, plan: StepPlan | None) -> None:
        """After the step's drafter: hand the step's slot mapping to the checks (an
        asynchronous copy and an event on a GPU; the engine never waits for the device),
        then ship the complete requests, each held by its sender until the step is done
        and checked (``slot_check``); in pull mode, hold them for consumers."""
        if plan is None or not plan or self.recorder is None or self.checks is None or not self._serving:
            self._slots = None
            return
        if self.pull is not None and plan.drops:
            self.pull.drop(plan.drops)
        for rid in plan.resets:
            self.recorder.forget(rid)
        errors: dict[str, str] = {}
        gate: StepGate | None = None
        if plan.slices and self._slots is None:
            errors = {sl.request_id: "the cache-only layer wrote no slots this step" for sl in plan.slices}
        elif plan.slices or plan.ships:
            expected, errors = self.recorder.expect(plan.slices)
            gate = self.checks.add(self._slots if plan.slices else None, expected)
        self._slots = None
        errors.update(self.checks.settle())  # on the host: this step's check, now
        for rid, why in errors.items():
            self._fail_unshipped(rid, why)
        for order in plan.ships:
            rid = order.request_id
            if rid in self._failed:
                if self.pull is not None:
                    self.pull.fail(rid, order.nonce, self._failed[rid])
                self._done.add(rid)
                continue
            try:
                blocks = self.recorder.ship_blocks(len(order.token_ids), order.block_ids)
                done, wrong = gate.poll(rid) if gate is not None else (True, None)
                if wrong is not None:
                    raise SlotMismatch(wrong)
                self._ship(order, blocks, None if done else gate)
                self._shipped.add(rid)
                self.metrics.shipped()
            except (SlotMismatch, ValueError, SenderError) as e:
                log.error("request %s cannot be shipped: %s", rid, e)
                self._failed[rid] = str(e)
                self._note_failure(rid, SampleFailure(FailureReason.OTHER, str(e)))
                if self.pull is not None:
                    self.pull.fail(rid, order.nonce, str(e))
                self._done.add(rid)
            self.recorder.forget(rid)

    @property
    def _serving(self) -> bool:
        return bool(self.senders) or self.pull is not None

    def _ship(self, order: ShipOrder, blocks: list[int], gate: StepGate | None) -> None:
        """Ship (push) or hold for consumers (pull) one computed sample. A pulled sample
        is fetched only after its request finished, steps after the one that wrote it."""
        if self.pull is not None:
            ident = order.identity
            self.pull.hold(
                order.request_id, order.nonce, order.token_ids, blocks, ident.sample_id, ident.metadata
            )
            if order.request_id in self._finished_by_scheduler:  # told first (output tokens)
                self.pull.finished([order.request_id])
        else:
            sender = self._sender_of(order.reader)
            sender.ship(order.request_id, order.token_ids, blocks, order.identity, ready=gate)

    def _fail_unshipped(self, rid: str, why: str) -> None:
        """A slice of the request was not written where its block table says (or not at
        all): it will not be shipped. One already shipped is failed by its sender (its
        gate says why), which reports it."""
        if rid in self._shipped or rid in self._failed:
            return
        log.error("request %s: %s; its hidden states will not be shipped", rid, why)
        self._failed[rid] = why
        self._note_failure(rid, SampleFailure(FailureReason.OTHER, why))

    def unregister_kv_caches(self) -> None:
        """vLLM goes to sleep and releases the cache's memory: each sender lets its shares
        in flight be acknowledged for up to ``drain_timeout_s``, fails the rest by name
        (their readers drop them), leaves its reader and deregisters the cache. Nothing
        reads the cache until ``restore_kv_caches``. Idempotent."""
        if self.asleep or not self.senders:
            return
        self.asleep = True
        why = (
            "vLLM went to sleep before the reader acknowledged it (sleep mode releases the cache "
            "holding its hidden states)"
        )
        t0 = time.monotonic()
        deadline = t0 + self.options.drain_timeout_s  # one wait for all readers: acks come in parallel
        failed = [rid for s in self.senders for rid in s.suspend(max(0.0, deadline - time.monotonic()), why)]
        log.info(
            "rank %d: asleep after %.3f s; %d requests in flight failed, NIXL registration released",
            self.rank,
            time.monotonic() - t0,
            len(failed),
        )

    def restore_kv_caches(self) -> None:
        """vLLM woke up: register the cache again (its memory may have moved) and connect
        to every reader again, which learns the new registration. Idempotent."""
        if not self.asleep or self.cache is None:
            return
        for s in self.senders:
            s.resume(self.cache)
        self.asleep = False
        log.info("rank %d: awake; the cache is registered again", self.rank)

    def handle_preemptions(self, plan: StepPlan | None) -> None:
        """Called before this step reuses preempted requests' blocks: a shipped request's
        share gets up to ``preempt_timeout_s`` to be safely written (granted, landed,
        hashed); one that is not by then fails (the reader drops it). Nothing is ever
        shipped from reused blocks, and a full or hung reader holds the step no longer."""
        if plan is None or not plan.preempted or not self._serving:
            return
        if self.recorder is not None:
            for rid in plan.preempted:
                self.recorder.forget(rid)
        if self.pull is not None:
            for rid in self.pull.preempt(plan.preempted):  # nothing is read from reused blocks
                why = "preempted by vLLM before a consumer fetched it"
                log.error("request %s: %s", rid, why)
                self._failed[rid] = why
                self._note_failure(rid, SampleFailure(FailureReason.PREEMPTED, why))
            return
        busy = [rid for rid in plan.preempted if rid in self._shipped]
        if not busy:
            return
        t0 = time.monotonic()
        unsafe = sum(s.count_unsafe(busy) for s in self.senders)
        failed = []
        for s in self.senders:
            failed += s.preempt(busy, max(0.0, t0 + self.options.preempt_timeout_s - time.monotonic()))
        log.info(
            "rank %d: %d tracked requests preempted, %d shipped ones not yet written; waited %.3f s, "
            "%d failed (not written within preempt_timeout_s)",
            self.rank,
            len(plan.preempted),
            unsafe,
            time.monotonic() - t0,
            len(failed),
        )

    def get_finished(self, finished_req_ids: set[str], shipping: set[str] | None = None) -> set[str] | None:
        """``shipping``: the requests this step's plan ships and ``wait_for_save`` has not
        yet (vLLM asks this first when a drafter runs): a request that ships its output
        tokens is shipped in the step that also tells the workers it finished."""
        if not self._serving:
            return None
        # only requests this worker shipped or failed, or ships this step, wait for their
        # finish here; the rest (never shipped: aborted, or failed at admission) must not pile up
        if self.checks is not None:
            for rid, why in self.checks.settle().items():
                self._fail_unshipped(rid, why)
        followed = self._shipped | self._done | (shipping or set())
        self._finished_by_scheduler |= finished_req_ids & followed
        for rid in finished_req_ids - followed:
            self._failed.pop(rid, None)
            if self.recorder is not None:
                self.recorder.forget(rid)
            if self.checks is not None:
                self.checks.forget(rid)
        if self.pull is not None:
            self.pull.finished(finished_req_ids & self._shipped)  # their handles are out: clocks start
            self._done |= self.pull.take_freed()  # released, expired, preempted or aborted
        for sender in self.senders:
            acked = sender.take_finished()
            self._done |= acked
            self._report_delivered |= acked
            for rid, failure in sender.take_failed().items():
                self._failed[rid] = failure.why
                self._note_failure(rid, failure)
                self._done.add(rid)
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

    def take_report(self) -> WorkerReport:
        """What the scheduler side should learn this step: changes of this rank's link
        to each reader (None: connected), and requests failed or delivered since."""
        links: list[LinkChange] = []
        endpoints: dict[int, str] = {}
        if self.pull is not None and PULL_ENDPOINTS not in self._reported_links:
            self._reported_links[PULL_ENDPOINTS] = None
            links.append(LinkChange(PULL_ENDPOINTS, self.rank, None))  # its endpoint listens
            endpoints[self.rank] = self.pull.address
        for sender in self.senders:
            err, reader = sender.link_error, sender.config.consumer_address
            last = self._reported_links.get(reader, "")
            if reader not in self._reported_links or (last is None) != (err is None):
                self._reported_links[reader] = err
                links.append(LinkChange(reader, self.rank, err))
        failures, self._report_failures = self._report_failures, {}
        delivered, self._report_delivered = self._report_delivered, set()
        return WorkerReport(links, failures, delivered, endpoints)

    def _sender_of(self, reader: str | None) -> HiddenStatesSender:
        """The sender to the reader a sample was bound for (ValueError: none or unknown)."""
        for s in self.senders:
            if s.config.consumer_address == reader:
                return s
        raise ValueError(f"no sender to the reader {reader!r} (readers: {', '.join(self.options.readers)})")

    def stats(self) -> list[SenderStats]:
        """A snapshot of each sender's counters, in the order of the readers."""
        return [s.stats() for s in self.senders]

    def step_stats(self) -> StepData | None:
        """This step's metrics (``step_stats``): the senders' counters and observations
        since the last step, and, on rank 0, the samples shipped, delivered and failed."""
        return self.metrics.take_from(self.senders)

    def _note_failure(self, rid: str, failure: SampleFailure) -> None:
        self.metrics.failed(failure.reason)
        self._report_failures[rid] = failure
        self.recent_failures[rid] = failure.why
        while len(self.recent_failures) > 1000:
            self.recent_failures.popitem(last=False)

    def shutdown(self) -> None:
        pull, self.pull = self.pull, None
        if pull is not None:
            pull.close()
        senders, self.senders = self.senders, []
        deadline = time.monotonic() + self.options.drain_timeout_s
        while any(s.unwritten for s in senders) and time.monotonic() < deadline:
            time.sleep(0.01)
        for s in senders:
            if s.unwritten:
                log.error(
                    "shutting down with %d hidden-state samples not delivered to %s after %.0f s",
                    s.unwritten,
                    s.config.consumer_address,
                    self.options.drain_timeout_s,
                )
            s.close()
