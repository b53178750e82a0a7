"""Worker side of the connector: registers the cache-only layer's tensor with NIXL, reads
each step's slot mapping, and hands complete requests to the sender."""

from __future__ import annotations

import atexit
import collections
import logging
import time
from typing import TYPE_CHECKING

import torch

from kv_connector.producer.options import Checksum, ConnectorOptions, pull_endpoint
from kv_connector.producer.planning import BlockRecorder, ShipOrder, SlotMismatch, StepPlan
from kv_connector.producer.pull_server import PullServer
from kv_connector.producer.step_stats import StepData, WorkerStats
from kv_connector.producer.worker_report import LinkChange, WorkerReport
from kv_connector.sender.loop import SenderError
from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
from kv_connector.sender.stats import SenderStats
from kv_connector.wire import block_digest
from kv_connector.wire.layout import BlockLayout, layout_from_view

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


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
        self.senders: list[HiddenStatesSender] = []
        self.pull: PullServer | None = None  # pull delivery: this rank's endpoint, instead of senders
        self.recorder: BlockRecorder | None = None
        self._slots: torch.Tensor | None = None
        self._shipped: set[str] = set()
        self._failed: dict[str, str] = {}
        self._done: set[str] = set()
        self._finished_by_scheduler: set[str] = set()
        # the last failures, for logs and tests (request id -> why); bounded
        self.recent_failures: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.rank = 0
        # for the scheduler (see take_report): link states as last reported, and news
        self._reported_links: dict[int, str | None] = {}
        self._report_failures: dict[str, str] = {}
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
        cache = kv_caches[self.layer_name]
        hidden = self.vllm_config.model_config.get_hidden_size()
        layout, block_size = layout_from_view(cache.shape, cache.stride(), len(self.layer_ids), hidden)
        block_layout = BlockLayout(
            layout,
            block_size,
            len(self.layer_ids),
            hidden,
            _dtype_name(cache.dtype),  # type: ignore[arg-type]
        )
        rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.rank = rank
        blocks = self.options.checksum.block_digests(cache.is_cuda, block_digest.supported(block_layout))
        if self.options.checksum is Checksum.NONE:
            checksum = "none"
        else:
            checksum = "block digests" if blocks else "XXH3 of the bytes"
        self.metrics = WorkerStats(rank)
        self.recorder = BlockRecorder(block_size)
        atexit.register(self.shutdown)
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
                checksum=self.options.checksum is not Checksum.NONE,
            )
            log.info(
                "hidden-states connector rank %d/%d: layer %s, %d blocks of %d tokens (%s, %s, %d bytes), "
                "pull delivery: serving at %s, samples held up to %.0f s",
                rank,
                world,
                self.layer_name,
                cache.shape[0],
                block_size,
                layout,
                block_layout.dtype,
                block_layout.block_bytes,
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
                    checksum=self.options.checksum is not Checksum.NONE,
                    block_digests=blocks,
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
        if plan is None or not plan or self.recorder is None or not self._serving:
            self._slots = None
            return
        if self.pull is not None and plan.drops:
            self.pull.drop(plan.drops)
        for rid in plan.resets:
            self.recorder.forget(rid)
        if plan.slices:
            if self._slots is None:
                errors = {
                    sl.request_id: "the cache-only layer wrote no slots this step" for sl in plan.slices
                }
            else:
                if self._slots.is_cuda:
                    torch.cuda.current_stream().synchronize()  # states written before WRITEs read them
                slots = self._slots.tolist()
                errors = self.recorder.record(slots, plan.slices)
            for rid, why in errors.items():
                log.error("request %s: %s; its hidden states will not be shipped", rid, why)
                self._failed.setdefault(rid, why)
                self._note_failure(rid, why)
        self._slots = None
        for order in plan.ships:
            rid = order.request_id
            if rid in self._failed:
                if self.pull is not None:
                    self.pull.fail(rid, order.nonce, self._failed[rid])
                self._done.add(rid)
                continue
            try:
                blocks, from_table = self.recorder.blocks(rid, len(order.token_ids), order.block_ids)
                if from_table:
                    log.debug("request %s: %d blocks from the prefix cache", rid, from_table)
                self._ship(order, blocks)
                self._shipped.add(rid)
                self.metrics.shipped()
            except (SlotMismatch, ValueError, SenderError) as e:
                log.error("request %s cannot be shipped: %s", rid, e)
                self._failed[rid] = str(e)
                self._note_failure(rid, str(e))
                if self.pull is not None:
                    self.pull.fail(rid, order.nonce, str(e))
                self._done.add(rid)
            self.recorder.forget(rid)

    @property
    def _serving(self) -> bool:
        return bool(self.senders) or self.pull is not None

    def _ship(self, order: ShipOrder, blocks: list[int]) -> None:
        """Ship (push) or hold for consumers (pull) one computed sample."""
        ident = order.identity
        if self.pull is not None:
            self.pull.hold(
                order.request_id, order.nonce, order.token_ids, blocks, ident.sample_id, ident.metadata
            )
        else:
            self.senders[order.reader].ship(
                order.request_id, order.token_ids, blocks, sample_id=ident.sample_id, metadata=ident.metadata
            )

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
                self._note_failure(rid, why)
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

    def get_finished(self, finished_req_ids: set[str]) -> set[str] | None:
        if not self._serving:
            return None
        # only requests this worker shipped or failed wait for their finish here; the
        # rest (never shipped: aborted, or failed at admission) must not pile up
        followed = self._shipped | self._done
        self._finished_by_scheduler |= finished_req_ids & followed
        for rid in finished_req_ids - followed:
            self._failed.pop(rid, None)
            if self.recorder is not None:
                self.recorder.forget(rid)
        if self.pull is not None:
            self.pull.finished(finished_req_ids & self._shipped)  # their handles are out: clocks start
            self._done |= self.pull.take_freed()  # released, expired, preempted or aborted
        for sender in self.senders:
            acked = sender.take_finished()
            self._done |= acked
            self._report_delivered |= acked
            for rid, why in sender.take_failed().items():
                self._failed[rid] = why
                self._note_failure(rid, why)
                self._done.add(rid)
        ready = self._done & self._finished_by_scheduler
        if not ready:
            return None
        self._done -= ready
        self._finished_by_scheduler -= ready
        self._shipped -= ready
        for rid in ready:
            self._failed.pop(rid, None)
        return ready

    def take_report(self) -> WorkerReport:
        """What the scheduler side should learn this step: changes of this rank's link
        to each reader (None: connected), and requests failed or delivered since."""
        links: list[LinkChange] = []
        endpoints: dict[int, str] = {}
        if self.pull is not None and 0 not in self._reported_links:
            self._reported_links[0] = None
            links.append(LinkChange(0, self.rank, None))  # its endpoint listens
            endpoints[self.rank] = self.pull.address
        for k, sender in enumerate(self.senders):
            err = sender.link_error
            last = self._reported_links.get(k, "")
            if k not in self._reported_links or (last is None) != (err is None):
                self._reported_links[k] = err
                links.append(LinkChange(k, self.rank, err))
        failures, self._report_failures = self._report_failures, {}
        delivered, self._report_delivered = self._report_delivered, set()
        return WorkerReport(links, failures, delivered, endpoints)

    def stats(self) -> list[SenderStats]:
        """A snapshot of each sender's counters, in the order of the readers."""
        return [s.stats() for s in self.senders]

    def step_stats(self) -> StepData | None:
        """This step's metrics (``step_stats``): the senders' counters and observations
        since the last step, and, on rank 0, the samples shipped, delivered and failed."""
        return self.metrics.take_from(self.senders)

    def _note_failure(self, rid: str, why: str) -> None:
        self.metrics.failed(why)
        self._report_failures[rid] = why
        self.recent_failures[rid] = why
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
