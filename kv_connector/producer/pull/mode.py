"""Pull delivery: each rank holds every sample in vLLM's cache and serves it from its own
endpoint (``pull_server.PullServer``) to the consumer that holds its handle, until that
consumer releases it or ``pull_timeout_s`` passes. The worker part (``PullWorker``)
holds, ends holds and reports the endpoint; the scheduler part (``PullScheduling``)
gives each request its nonce, learns the ranks' endpoints and hands out each finished
request's handle."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kv_connector.cache.blocks import Fingerprinted
from kv_connector.common.errors import ClosedError
from kv_connector.producer.delivery import Admission, DeliveryBook
from kv_connector.producer.idle_steps import HOLD_NAP_S
from kv_connector.producer.mode import Finished, RankCache, Settled
from kv_connector.producer.options import ConnectorOptions, pull_endpoint
from kv_connector.producer.planning import ShipOrder
from kv_connector.producer.pull.server import PullServer, PullServerConfig
from kv_connector.producer.slot_check import StepGate
from kv_connector.producer.worker_report import LinkChange, WorkerReport
from kv_connector.wire.failure import FailureReason, SampleFailure
from kv_connector.wire.handle import PullHandle, make_nonce
from kv_connector.wire.outcome import SampleOutcome, SampleStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndHolds:
    """The scheduler part's news for the workers (``StepPlan.news``): these requests failed
    at their finish, nobody got their handle, so every rank ends its hold."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Serving:
    """A rank's news for the scheduler part (``WorkerReport.news``): it serves pulled
    samples at ``address`` (``HOST:PORT``), which every handle names."""

    rank: int
    address: str


class PullWorker:
    """This rank's pull endpoint.

    Besides the core ``WorkerMode`` it is ``HoldsSamples``. It keeps the cache registered
    while vLLM sleeps, and consumers come to it: it waits for no peer."""

    def __init__(self, options: ConnectorOptions, rc: RankCache) -> None:
        self.options = options
        self.rank = rc.rank
        self.server: PullServer | None = PullServer(
            rc.cache,
            PullServerConfig(
                layout=rc.layout,
                layer_ids=tuple(rc.layer_ids),
                producer_id=rc.producer_id,
                listen=pull_endpoint(options.pull.listen, rc.replica * rc.world_size + rc.rank),
                timeout_s=options.pull.timeout_s,
                rank=rc.rank,
                world_size=rc.world_size,
                checksum=rc.checksum,
                provenance=rc.provenance,
            ),
            on_release=rc.news,
        )
        # its endpoint was reported to the scheduler
        self._reported = False

    @property
    def _server(self) -> PullServer:
        if self.server is None:
            raise ClosedError("the pull endpoint is closed")
        return self.server

    def describe(self) -> str:
        return (
            f"pull delivery: serving at {self._server.address}, samples held up to "
            f"{self.options.pull.timeout_s:.0f} s"
        )

    def ship(
        self,
        order: ShipOrder,
        blocks: list[int],
        gate: StepGate | None,
        told_finished: bool,
        words: Fingerprinted | None,
    ) -> None:
        """Hold the sample for consumers. It is fetched only after its request finished,
        after the step that wrote it returned; a fetch waits for ``gate`` (the step's slot
        check, on a GPU a step late) and is refused if it failed."""
        ident = order.identity
        s = self._server
        rid, tokens = order.request_id, order.token_ids
        s.hold(rid, order.route or "", tokens, blocks, ident.sample_id, ident.metadata, words, ready=gate)
        # told first (its request ships its output tokens)
        if told_finished:
            s.finished([rid])

    def refuse(self, order: ShipOrder, why: str) -> None:
        self._server.fail(order.request_id, order.route or "", why)

    def fail_held(self, request_id: str, why: str) -> bool:
        return self._server.fail_held(request_id, why)

    def hear(self, news: object) -> None:
        if isinstance(news, EndHolds) and news.request_ids:
            self._server.drop(news.request_ids)

    def preempt(self, request_ids: Sequence[str], shipped: set[str]) -> dict[str, SampleFailure]:
        """Their holds end now: nothing is read from reused blocks."""
        why = "preempted by vLLM before a consumer fetched it"
        failed = self._server.preempt(request_ids)
        for rid in failed:
            log.error("request %s: %s", rid, why)
        return {rid: SampleFailure(FailureReason.PREEMPTED, why) for rid in failed}

    def finished(self, request_ids: set[str]) -> None:
        # their handles are out: the clocks start
        self._server.finished(request_ids)

    def settle(self) -> Settled:
        # released, expired, preempted or aborted
        return Settled(done=self._server.take_freed())

    def link_changes(self) -> tuple[list[LinkChange], list[object]]:
        """No links (consumers come to it); once, where it serves."""
        if self._reported:
            return [], []
        self._reported = True
        return [], [Serving(self.rank, self._server.address)]

    def close(self, drain_timeout_s: float) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.close()


class PullScheduling:
    """The scheduler side's part of pull delivery."""

    def __init__(
        self, options: ConnectorOptions, book: DeliveryBook, producer_id: str, world_size: int
    ) -> None:
        self.book = book
        self.producer_id = producer_id
        self.world_size = world_size
        # an engine that only holds samples waits for consumers: it steps only to notice
        # an expiry (a release, or a new request, ends its nap), a quarter of the hold late at most
        self.hold_nap_s: float | None = min(HOLD_NAP_S, options.pull.timeout_s / 4)
        # each rank's endpoint, as reported
        self.endpoints: dict[int, str] = {}
        # failed at their finish: their holds must end
        self._drops: list[str] = []
        # each unfinished request's handle secret
        self._nonces: dict[str, str] = {}

    def on_new_request(self, request_id: str) -> None:
        self._nonces[request_id] = make_nonce()

    def route(self, request_id: str) -> str | None:
        """Its nonce: every rank holds the sample under it, and its handle carries it."""
        return self._nonces.get(request_id)

    def admit(self, request_id: str) -> Admission:
        """Once every rank reported its endpoint (at the engine's first step): vLLM asks
        for a finished request's kv_transfer_params before it hands the connector that
        step's reports, and a handle names every rank's endpoint. For at most
        ``connect_timeout_s``."""
        decided = self.book.decided(request_id)
        if decided is not None:
            return decided
        if not self._missing():
            return self.book.run(request_id, None)
        return self.book.wait_or_fail(
            request_id,
            lambda: (
                f"ranks {self._missing()} reported no pull endpoint for {self.book.connect_timeout_s:.0f} s"
            ),
        )

    def started(self, request_id: str) -> str | None:
        """A request vLLM ran without admitting it is held and served like any other."""
        rec = self.book.table.get(request_id)
        if rec is None or rec.admitted or rec.failed is not None:
            return None
        self.book.run(request_id, None)
        return "the ranks' pull endpoints"

    def reachable(self) -> int:
        """1 once every rank serves its endpoint."""
        return int(not self._missing())

    def _missing(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.endpoints]

    def update(self, report: WorkerReport) -> None:
        for news in report.news:
            if isinstance(news, Serving):
                log.info("rank %d serves pulled samples at %s", news.rank, news.address)
                self.endpoints[news.rank] = news.address

    def news(self) -> EndHolds | None:
        drops, self._drops = self._drops, []
        return EndHolds(tuple(drops)) if drops else None

    def request_finished(self, done: Finished) -> dict[str, Any]:
        """The sample's ``handle`` (top level, where speculators looks) and its record:
        "ready", or "failed" with an "error"; a failed one's hold ends."""
        nonce = self._nonces.pop(done.request_id, "")
        status, error = done.status, done.error
        missing = self._missing()
        if done.aborted:
            status, error = SampleStatus.FAILED, "the request was aborted"
        elif status is not SampleStatus.FAILED and missing:
            status, error = SampleStatus.FAILED, f"ranks {missing} reported no pull endpoint"
        outcome = SampleOutcome(
            status=SampleStatus.FAILED if status is SampleStatus.FAILED else SampleStatus.READY,
            producer_id=self.producer_id,
            request_id=done.request_id,
            sample_id=done.identity.name_of(done.request_id),
            consumer_address=None,
            error=error,
            delivery="pull",
        )
        if outcome.status is SampleStatus.FAILED:
            if done.hold:
                # nobody gets its handle: the workers end its hold
                self._drops.append(done.request_id)
            return outcome.params()
        endpoints = [self.endpoints[r] for r in range(self.world_size)]
        handle = PullHandle(self.producer_id, done.request_id, nonce, endpoints).encode()
        return {"handle": handle, **outcome.params()}
