"""Push delivery: each rank WRITEs every sample into the pool of the reader its request was bound to.

There is one ``HiddenStatesSender`` per reader (``sender/``). The worker part
(``PushWorker``) ships, and settles what the readers acknowledged or what failed. It
suspends the senders while vLLM sleeps. The scheduler part (``PushScheduling``) logs the
ranks' links and tells each finished request which reader has its sample."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from kv_connector.cache.blocks import Fingerprinted
from kv_connector.common.errors import ConfigurationError
from kv_connector.producer.delivery import Admission, DeliveryBook
from kv_connector.producer.mode import Finished, RankCache, Settled
from kv_connector.producer.options import ConnectorOptions
from kv_connector.producer.planning import ShipOrder
from kv_connector.producer.push.admission import ReaderAdmission, Router
from kv_connector.producer.slot_check import StepGate
from kv_connector.producer.step_stats import MetricsSource
from kv_connector.producer.worker_report import LinkChange, WorkerReport
from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
from kv_connector.sender.stats import SenderStats
from kv_connector.wire.failure import SampleFailure
from kv_connector.wire.outcome import SampleOutcome, SampleStatus

log = logging.getLogger(__name__)


class PushWorker:
    """This rank's senders, one per reader, in the order of the readers.

    Besides the core ``WorkerMode`` it is ``ReleasesCache`` and ``SendsToReaders``. A sample
    it cannot ship was told to no reader, so it needs no word of refusals: the
    scheduler's outcome says why."""

    def __init__(self, options: ConnectorOptions, rc: RankCache) -> None:
        self.options = options
        self.rank = rc.rank
        self.senders = [
            HiddenStatesSender(
                SenderConfig(
                    consumer_address=address,
                    producer_id=rc.producer_id,
                    rank=rc.rank,
                    world_size=rc.world_size,
                    connect_timeout_s=options.connect_timeout_s,
                    checksum=rc.checksum,
                    sample_timeout_s=options.push.sample_timeout_s,
                    on_outcome=rc.news,
                    provenance=rc.provenance,
                    credits_ahead=options.push.credits_ahead,
                ),
                rc.cache,
                rc.layout,
                rc.layer_ids,
            )
            for address in options.push.readers
        ]
        # reader -> its last reported link error
        self._reported: dict[str, str | None] = {}

    def describe(self) -> str:
        return f"shipping to {', '.join(self.options.push.readers)}"

    def ship(
        self,
        order: ShipOrder,
        blocks: list[int],
        gate: StepGate | None,
        told_finished: bool,
        words: Fingerprinted | None,
    ) -> None:
        sender = self._sender_of(order.route)
        sender.ship(order.request_id, order.token_ids, blocks, order.identity, ready=gate, words=words)

    def preempt(self, request_ids: Sequence[str], shipped: set[str]) -> dict[str, SampleFailure]:
        """A shipped request's share gets up to ``preempt_timeout_s`` to be safely written.

        Safely written means granted, landed and hashed. One that is not by then fails: the
        reader drops it, and the sender reports it at ``settle``. A full or hung reader holds
        the step no longer."""
        busy = [rid for rid in request_ids if rid in shipped]
        if not busy:
            return {}
        t0 = time.monotonic()
        unsafe = sum(s.count_unsafe(busy) for s in self.senders)
        failed = []
        for s in self.senders:
            failed += s.preempt(busy, max(0.0, t0 + self.options.push.preempt_timeout_s - time.monotonic()))
        log.info(
            "rank %d: %d tracked requests preempted, %d shipped ones not yet written; waited %.3f s, "
            "%d failed (not written within preempt_timeout_s)",
            self.rank,
            len(request_ids),
            unsafe,
            time.monotonic() - t0,
            len(failed),
        )
        return {}

    def settle(self) -> Settled:
        out = Settled()
        for sender in self.senders:
            acked = sender.take_finished()
            out.done |= acked
            out.delivered |= acked
            for rid, failure in sender.take_failed().items():
                out.failed[rid] = failure
                out.done.add(rid)
        return out

    def link_changes(self) -> tuple[list[LinkChange], list[object]]:
        links: list[LinkChange] = []
        for sender in self.senders:
            err, reader = sender.link_error, sender.config.consumer_address
            last = self._reported.get(reader, "")
            if reader not in self._reported or (last is None) != (err is None):
                self._reported[reader] = err
                links.append(LinkChange(reader, self.rank, err))
        return links, []

    def sleep(self, why: str, timeout_s: float) -> None:
        """Each sender lets its shares in flight be acknowledged for up to ``timeout_s``.

        There is one wait for all readers, since acks come in parallel. Each sender then
        fails the rest by name (their readers drop them), leaves its reader and deregisters
        the cache."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        failed = [rid for s in self.senders for rid in s.suspend(max(0.0, deadline - time.monotonic()), why)]
        log.info(
            "rank %d: asleep after %.3f s; %d requests in flight failed, NIXL registration released",
            self.rank,
            time.monotonic() - t0,
            len(failed),
        )

    def wake(self, cache: torch.Tensor) -> None:
        for s in self.senders:
            s.resume(cache)

    def metrics_sources(self) -> Sequence[MetricsSource]:
        return self.senders

    def stats(self) -> list[SenderStats]:
        return [s.stats() for s in self.senders]

    def wait_connected(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(s.connected.wait(max(0.0, deadline - time.monotonic())) for s in self.senders)

    def close(self, drain_timeout_s: float) -> None:
        senders, self.senders = self.senders, []
        deadline = time.monotonic() + drain_timeout_s
        while any(s.unwritten for s in senders) and time.monotonic() < deadline:
            time.sleep(0.01)
        for s in senders:
            if s.unwritten:
                log.error(
                    "shutting down with %d hidden-state samples not delivered to %s after %.0f s",
                    s.unwritten,
                    s.config.consumer_address,
                    drain_timeout_s,
                )
            s.close()

    def _sender_of(self, reader: str | None) -> HiddenStatesSender:
        """The sender to the reader a sample was bound for (ValueError: none or unknown)."""
        for s in self.senders:
            if s.config.consumer_address == reader:
                return s
        readers = ", ".join(self.options.push.readers)
        raise ConfigurationError(f"no sender to the reader {reader!r} (readers: {readers})")


class PushScheduling:
    """The scheduler side's part of push delivery."""

    def __init__(
        self, options: ConnectorOptions, book: DeliveryBook, producer_id: str, world_size: int
    ) -> None:
        self.options = options
        self.producer_id = producer_id
        self.book = book
        # push: the short naps only
        self.hold_nap_s: float | None = None
        router = Router(options.push.readers, options.push.sharding)
        self.admission = ReaderAdmission(book, options.push.readers, world_size, router)
        # readers every rank reaches, recounted when a link changes
        self._reachable = 0

    def admit(self, request_id: str) -> Admission:
        """Not while no worker reaches the request's reader, for at most ``connect_timeout_s``."""
        return self.admission.admit(request_id)

    def started(self, request_id: str) -> str | None:
        return self.admission.started(request_id)

    def reachable(self) -> int:
        return self._reachable

    def update(self, report: WorkerReport) -> None:
        self.admission.links(report.links)
        if report.links:
            self._reachable = sum(self.admission.is_up(r) for r in self.options.push.readers)
        for reader, rank, error in report.links:
            if reader not in self.options.push.readers:
                continue
            if error is None:
                log.info("rank %d reaches the reader at %s", rank, reader)
            else:
                log.warning("rank %d cannot reach the reader at %s: %s", rank, reader, error)

    def route(self, request_id: str) -> str | None:
        """The reader the delivery book bound the request to at admission (its address)."""
        rec = self.book.table.get(request_id)
        return rec.reader if rec is not None else None

    def request_finished(self, done: Finished) -> dict[str, Any]:
        """The sample's request id, sample id, reader and status.

        The status is "delivered", "failed" with an "error", or "pending" (on its way). One
        that failed before it ran names the reader it was bound for."""
        reader = self.route(done.request_id)
        if reader is None and done.status is SampleStatus.FAILED:
            reader = self.admission.bound(done.request_id)
        return SampleOutcome(
            status=done.status,
            producer_id=self.producer_id,
            request_id=done.request_id,
            sample_id=done.identity.name_of(done.request_id),
            consumer_address=reader,
            error=done.error,
        ).params()
