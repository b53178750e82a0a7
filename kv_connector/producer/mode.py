"""A delivery mode as the producer's adapters see it.

It is what the worker side (``worker_side.WorkerSide``) and the scheduler side
(``scheduler_side.SchedulerSide``) ask of push and of pull. In push (``push.mode``) each
rank WRITEs every sample into a reader's pool. In pull (``pull.mode``) each rank holds
every sample in vLLM's cache until a consumer READs and releases it. The adapters keep
what both modes share: the plan, the slot checks, the requests' records, the delivery
book. Each holds one mode, chosen once from the options' ``delivery`` (``modes``), and no
other branch on the mode.

A mode implements the core protocol (``WorkerMode``, ``SchedulerMode``) and, where it
does something there, an optional capability: ``HoldsSamples`` (pull: samples wait for
a consumer), ``ReleasesCache`` (push: sleep mode), ``SendsToReaders`` (push: senders
with counters and links), ``HandsOutHandles`` (pull: nonces and ended holds). The
adapters ask a mode for a capability once, not for a no-op."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from kv_connector.cache.blocks import Fingerprinted
from kv_connector.producer.delivery import Admission, DeliveryBook
from kv_connector.producer.options import ConnectorOptions
from kv_connector.producer.planning import ShipOrder
from kv_connector.producer.slot_check import StepGate
from kv_connector.producer.worker_report import LinkChange, WorkerReport
from kv_connector.wire.failure import SampleFailure
from kv_connector.wire.identity import SampleIdentity
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.outcome import SampleStatus
from kv_connector.wire.protocol import ShareChecksum
from kv_connector.wire.provenance import Provenance

if TYPE_CHECKING:
    from kv_connector.producer.step_stats import MetricsSource
    from kv_connector.sender.stats import SenderStats


@dataclass(frozen=True, kw_only=True)
class RankCache:
    """What a worker mode serves from: this rank's cache-only layer and who it is."""

    cache: torch.Tensor
    layout: BlockLayout
    layer_ids: list[int]
    producer_id: str
    rank: int
    world_size: int
    # how each share's integrity record is taken
    checksum: ShareChecksum | None
    # rings the scheduler side's doorbell (``engine_bell``): a sample's outcome is news for the next step
    news: Callable[[], None] = lambda: None
    # what produced the samples (``wire.provenance``)
    provenance: Provenance | None = None
    # this engine's data-parallel replica (``options.replica_of``)
    replica: int = 0


@dataclass
class Settled:
    """What a worker mode settled since it was last asked.

    ``done``: requests whose blocks may go back to vLLM (delivered, failed, released,
    expired). ``delivered``: those a reader acknowledged. ``failed``: those that failed
    after they were shipped, and why."""

    done: set[str] = field(default_factory=set)
    delivered: set[str] = field(default_factory=set)
    failed: dict[str, SampleFailure] = field(default_factory=dict)


class WorkerMode(Protocol):
    """One rank's delivery of the samples its worker side ships, named after the hooks
    that call it."""

    def describe(self) -> str:
        """Where the samples go, for the start-up log line."""
        ...

    def ship(
        self,
        order: ShipOrder,
        blocks: list[int],
        gate: StepGate | None,
        told_finished: bool,
        words: Fingerprinted | None,
    ) -> None:
        """Deliver one computed sample from ``blocks`` (``wait_for_save``).

        Nothing reads them before ``gate`` (None: the step is done and checked) says so.
        ``told_finished``: the scheduler already said its request finished. ``words``: its
        fingerprint words as its steps took them. A ``KvConnectorError`` or ValueError: it
        cannot be delivered, and nothing was queued."""
        ...

    def preempt(self, request_ids: Sequence[str], shipped: set[str]) -> dict[str, SampleFailure]:
        """vLLM reuses these requests' blocks from this step on (``handle_preemptions``).

        Nothing may read them afterwards. Returns the failures to report now."""
        ...

    def settle(self) -> Settled:
        """What settled since the last call (``get_finished``)."""
        ...

    def link_changes(self) -> tuple[list[LinkChange], list[object]]:
        """Changes of this rank's links since the last call, and the mode's own news for its
        scheduler part (``WorkerReport.news``; ``build_connector_worker_meta``)."""
        ...

    def close(self, drain_timeout_s: float) -> None:
        """Stop: what is in flight gets up to ``drain_timeout_s``."""
        ...


@runtime_checkable
class HoldsSamples(Protocol):
    """A worker mode whose samples wait for a consumer (pull).

    The worker side tells it of samples it will not deliver, holds to end and requests
    that finished."""

    def refuse(self, order: ShipOrder, why: str) -> None:
        """The sample will not be delivered (its slots were wrong): a consumer that asks
        for it is told ``why``."""
        ...

    def fail_held(self, request_id: str, why: str) -> bool:
        """A held sample's check failed after it was held (on a GPU, a step late): its hold
        ends and a consumer is told ``why``. False where it is not held."""
        ...

    def hear(self, news: object) -> None:
        """The scheduler part's news for this step (``StepPlan.news``, from
        ``HandsOutHandles.news``), before the step's ships: e.g. holds to end, whose
        requests failed at their finish, so nobody got their handle."""
        ...

    def finished(self, request_ids: set[str]) -> None:
        """These shipped requests finished in vLLM (``get_finished``)."""
        ...


@runtime_checkable
class ReleasesCache(Protocol):
    """A worker mode that stops reading the cache while vLLM sleeps (push).

    A mode without it keeps serving from the cache's registration."""

    def sleep(self, why: str, timeout_s: float) -> None:
        """vLLM releases the cache's memory (``unregister_kv_caches``): stop reading it."""
        ...

    def wake(self, cache: torch.Tensor) -> None:
        """The cache is back, maybe elsewhere (``restore_kv_caches``)."""
        ...


@runtime_checkable
class SendsToReaders(Protocol):
    """A worker mode with a sender per reader (push): counters, metrics and links."""

    def metrics_sources(self) -> Sequence[MetricsSource]:
        """Where this step's transfer metrics come from (``get_kv_connector_stats``)."""
        ...

    def stats(self) -> Sequence[SenderStats]:
        """A snapshot of the counters, one per reader."""
        ...

    def wait_connected(self, timeout_s: float) -> bool:
        """Until every reader is reached; False after ``timeout_s``."""
        ...


@dataclass(frozen=True)
class Finished:
    """A request the scheduler side saw finish, with what both modes know of it."""

    request_id: str
    identity: SampleIdentity
    # its blocks are held for its delivery
    hold: bool
    status: SampleStatus
    # why it failed ("" unless failed)
    error: str
    aborted: bool


class SchedulerMode(Protocol):
    """The scheduler side's part of a delivery mode."""

    # how long the engine may nap while it holds samples and has no request in it
    # (``idle_steps``), None: no longer than the short naps
    hold_nap_s: float | None

    def admit(self, request_id: str) -> Admission:
        """May the request start now (``get_num_new_matched_tokens``)?

        WAIT: it waits in vLLM's queue, holding no blocks. FAIL: it runs without shipping."""
        ...

    def started(self, request_id: str) -> str | None:
        """vLLM scheduled a request it ran without admitting (``build_connector_meta``); it is bound now.

        Returns where its sample goes, for the log (None: nothing was bound)."""
        ...

    def reachable(self) -> int:
        """How many of this mode's peers every rank reaches, for the metrics."""
        ...

    def update(self, report: WorkerReport) -> None:
        """The workers' report of one step (``update_connector_output``), before the
        delivery book takes it."""
        ...

    def route(self, request_id: str) -> str | None:
        """What the workers' modes address the request's sample by (``ShipOrder.route``),
        asked when its ship is planned, before its finish."""
        ...

    def request_finished(self, done: Finished) -> dict[str, Any]:
        """The finished request's kv_transfer_params (``request_finished``).

        Asked of every request that finishes, once; the scheduler side returns them only
        where something was shipped or failed. The mode forgets the request afterwards."""
        ...


@runtime_checkable
class HandsOutHandles(Protocol):
    """A scheduler mode that hands each finished request a handle (pull).

    Each request gets a nonce when it arrives, its handle's secret and its route; the
    workers hear which holds to end (a request that failed at its finish)."""

    def on_new_request(self, request_id: str) -> None:
        """A new request is followed: it gets its nonce."""
        ...

    def news(self) -> object | None:
        """What the workers must hear this step (``StepPlan.news``; ``build_connector_meta``),
        in a record of the mode's own; None: nothing."""
        ...


# what ``modes`` hands each side: the maker of its part of the chosen delivery mode
WorkerModeMaker = Callable[[ConnectorOptions, RankCache], WorkerMode]
SchedulerModeMaker = Callable[[ConnectorOptions, DeliveryBook, str, int], SchedulerMode]
