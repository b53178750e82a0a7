"""The producer's metrics, one engine step at a time, in the form vLLM carries a KV connector's stats.

Each step a plain dict (``StepData``) is taken from each worker rank and from the
scheduler side, and merged over the ranks. It is sent to the API server as msgpack, so
it holds only str keys, ints, floats and lists. There it is observed into Prometheus
(``connector_metrics``). Pure logic.

What each side reports (``StepStats`` builds one side's dict):

* every worker rank: its senders' bytes written, WRITEs, rewrites, WRITE retries,
  reconnects and samples placed in credits ahead (deltas since the last step), each
  WRITE's latency and each sample's wait for credits (raw values, for histograms), and
  its samples in flight (a level);
* worker rank 0 only: samples shipped, delivered and failed by reason. Every rank has a
  job for every sample, so one rank counts each sample once;
* the scheduler side: requests that never ran their ship (their reader stayed
  unreachable: failed, ``unreachable``), and the levels of its book: readers every rank
  reaches, requests waiting for one, KV blocks finished requests hold for shipping.

Counts and raw values are deltas. Levels are sent when they change, by source (``rank0``,
``scheduler``), and the API server keeps the last value of each (``LevelBook``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypedDict, TypeVar

from kv_connector.common.observe import quantile
from kv_connector.sender.stats import SenderMetrics, SenderStats
from kv_connector.wire.failure import FailureReason

# vLLM unregisters only "vllm:*" collectors between loggers
PREFIX = "vllm:hidden_states_"
SCHEDULER_SOURCE = "scheduler"


class Count(enum.Enum):
    """Counters (deltas per step)."""

    SHIPPED = "shipped"
    DELIVERED = "delivered"
    BYTES_WRITTEN = "bytes_written"
    WRITES = "writes"
    REWRITES = "rewrites"
    WRITE_RETRIES = "write_retries"
    RECONNECTS = "reconnects"
    PLACED_AHEAD = "placed_ahead"


class Observed(enum.Enum):
    """Raw observations (seconds), for histograms."""

    WRITE_LATENCY = "write_latency_s"
    CREDIT_WAIT = "credit_wait_s"


class Combine(enum.Enum):
    SUM = "sum"
    MAX = "max"


class Level(enum.Enum):
    """Gauges: the last value each source reported, combined over the sources."""

    READERS_REACHABLE = "readers_reachable"
    SAMPLES_IN_FLIGHT = "samples_in_flight"
    REQUESTS_WAITING = "requests_waiting_for_reader"
    KV_BLOCKS_HELD = "kv_blocks_held"

    @property
    def combine(self) -> Combine:
        # every rank has a job for every sample: a sample is in flight while the
        # slowest rank still has it
        return Combine.MAX if self is Level.SAMPLES_IN_FLIGHT else Combine.SUM


class MetricSpec(NamedTuple):
    name: str
    doc: str


COUNTERS: dict[Count, MetricSpec] = {
    Count.SHIPPED: MetricSpec(
        PREFIX + "samples_shipped", "Samples handed to the senders (one per request shipped)."
    ),
    Count.DELIVERED: MetricSpec(PREFIX + "samples_delivered", "Samples the reader acknowledged."),
    Count.BYTES_WRITTEN: MetricSpec(
        PREFIX + "written_bytes", "Bytes landed in readers by completed WRITEs, all ranks, rewrites included."
    ),
    Count.WRITES: MetricSpec(PREFIX + "writes", "Completed NIXL WRITEs, all ranks."),
    Count.REWRITES: MetricSpec(
        PREFIX + "rewrites", "Shares written again because the reader's checksum failed, all ranks."
    ),
    Count.WRITE_RETRIES: MetricSpec(
        PREFIX + "write_retries", "WRITEs posted again after failing in NIXL, all ranks."
    ),
    Count.RECONNECTS: MetricSpec(
        PREFIX + "reconnects", "Connections to a reader made again after one was lost, all ranks."
    ),
    Count.PLACED_AHEAD: MetricSpec(
        PREFIX + "samples_placed_ahead",
        "Samples placed in pages a reader granted ahead, with no credit round trip (an engine of one rank).",
    ),
}
FAILED = MetricSpec(PREFIX + "samples_failed", "Samples that will never reach a reader, by reason.")
HISTOGRAMS: dict[Observed, MetricSpec] = {
    Observed.WRITE_LATENCY: MetricSpec(
        PREFIX + "write_latency_seconds", "From posting a WRITE to its completion, all ranks."
    ),
    Observed.CREDIT_WAIT: MetricSpec(
        PREFIX + "credit_wait_seconds",
        "From a sample's submission to the reader's grant of pages for it, all ranks.",
    ),
}
GAUGES: dict[Level, MetricSpec] = {
    Level.READERS_REACHABLE: MetricSpec(PREFIX + "readers_reachable", "Readers every worker rank reaches."),
    Level.SAMPLES_IN_FLIGHT: MetricSpec(
        PREFIX + "samples_in_flight", "Samples shipped and not yet acknowledged or failed (slowest rank)."
    ),
    Level.REQUESTS_WAITING: MetricSpec(
        PREFIX + "requests_waiting_for_reader", "New requests held in vLLM's queue until their reader is up."
    ),
    Level.KV_BLOCKS_HELD: MetricSpec(
        PREFIX + "kv_blocks_held",
        "KV cache blocks of finished requests held until their sample is acknowledged.",
    ),
}


class StepData(TypedDict):
    # Count value -> delta
    counts: dict[str, int]
    # FailureReason value -> delta
    failed: dict[str, int]
    # Observed value -> raw values
    observed: dict[str, list[float]]
    # Level value -> {source: value}
    levels: dict[str, dict[str, int]]


def empty() -> StepData:
    return {"counts": {}, "failed": {}, "observed": {}, "levels": {}}


def is_empty(data: Mapping[str, object]) -> bool:
    return not any(data.get(k) for k in ("counts", "failed", "observed", "levels"))


def merge(earlier: Mapping[str, object], later: Mapping[str, object]) -> StepData:
    """Two steps' or two sides' data in a new dict; neither is changed.

    Counts add up, raw values are joined, and levels are kept by source (the later wins)."""
    out = empty()
    for d in (earlier, later):
        for k, n in _section(d, "counts").items():
            out["counts"][k] = out["counts"].get(k, 0) + int(n)
        for k, n in _section(d, "failed").items():
            out["failed"][k] = out["failed"].get(k, 0) + int(n)
        for k, values in _section(d, "observed").items():
            out["observed"].setdefault(k, []).extend(float(v) for v in values)
        for k, by_source in _section(d, "levels").items():
            out["levels"].setdefault(k, {}).update({str(s): int(v) for s, v in by_source.items()})
    return out


def _section(data: Mapping[str, object], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    return value if isinstance(value, Mapping) else {}


E = TypeVar("E", bound=enum.Enum)


def known(kind: type[E], values: Iterable[str]) -> list[E]:
    """The members of ``kind`` among ``values`` (a newer peer's unknown keys skipped)."""
    by_value = {m.value: m for m in kind}
    return [by_value[v] for v in values if v in by_value]


def summary(data: StepData) -> dict[str, int | float]:
    """The human summary vLLM logs every ``VLLM_LOG_STATS_INTERVAL`` ("KV Transfer
    metrics: ...")."""
    counts, observed = data["counts"], data["observed"]
    writes = observed.get(Observed.WRITE_LATENCY.value, [])
    waits = observed.get(Observed.CREDIT_WAIT.value, [])
    return {
        "samples shipped": counts.get(Count.SHIPPED.value, 0),
        "delivered": counts.get(Count.DELIVERED.value, 0),
        "failed": sum(data["failed"].values()),
        "MB written": round(counts.get(Count.BYTES_WRITTEN.value, 0) / 1e6, 3),
        "WRITE ms avg": round(1e3 * sum(writes) / len(writes), 3) if writes else 0.0,
        "WRITE ms p90": round(1e3 * quantile(writes, 0.9), 3),
        "credit wait ms avg": round(1e3 * sum(waits) / len(waits), 3) if waits else 0.0,
        "rewrites": counts.get(Count.REWRITES.value, 0),
        "reconnects": counts.get(Count.RECONNECTS.value, 0),
        "placed ahead": counts.get(Count.PLACED_AHEAD.value, 0),
    }


class StepStats:
    """One side's (a worker rank's, or the scheduler side's) data until the next step.
    Not thread-safe: fed and taken on the engine's thread."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._data = empty()
        self._sent_levels: dict[Level, int] = {}
        # something was recorded since the last take
        self.pending = False

    def count(self, kind: Count, amount: int = 1) -> None:
        if amount:
            c = self._data["counts"]
            c[kind.value] = c.get(kind.value, 0) + int(amount)
            self.pending = True

    def fail(self, reason: FailureReason, amount: int = 1) -> None:
        f = self._data["failed"]
        f[reason.value] = f.get(reason.value, 0) + amount
        self.pending = True

    def observe(self, kind: Observed, values: Iterable[float]) -> None:
        values = [float(v) for v in values]
        if values:
            self._data["observed"].setdefault(kind.value, []).extend(values)
            self.pending = True

    def level(self, kind: Level, value: int) -> None:
        """A level, sent when it differs from the last one sent."""
        if self._sent_levels.get(kind) != value:
            self._sent_levels[kind] = int(value)
            self._data["levels"].setdefault(kind.value, {})[self.source] = int(value)
            self.pending = True

    def take(self) -> StepData | None:
        """What was recorded since the last take (None: nothing), and start afresh."""
        if not self.pending:
            return None
        out, self._data, self.pending = self._data, empty(), False
        return out


class LevelBook:
    """The API server's last level of every source, combined over the sources."""

    def __init__(self) -> None:
        self._last: dict[Level, dict[str, int]] = {}

    def update(self, levels: Mapping[str, Mapping[str, int]]) -> dict[Level, int]:
        """Take one step's levels; returns the combined value of every level they touched."""
        out: dict[Level, int] = {}
        for kind in known(Level, levels):
            last = self._last.setdefault(kind, {})
            last.update({str(s): int(v) for s, v in levels[kind.value].items()})
            out[kind] = max(last.values()) if kind.combine is Combine.MAX else sum(last.values())
        return out


class MetricsSource(Protocol):
    """What a worker's metrics read of a sender (``HiddenStatesSender``)."""

    def metrics_mark(self) -> tuple[int, ...]: ...

    def take_metrics(self) -> SenderMetrics: ...


class WorkerStats:
    """One worker rank's step data: its senders' counters and observations (every rank)
    and the samples (rank 0 only)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._step = StepStats(f"rank{rank}")
        self._marks: dict[int, SenderStats] = {}
        self._fingerprints: list[tuple[int, ...]] = []

    @property
    def counts_samples(self) -> bool:
        return self.rank == 0

    @property
    def pending(self) -> bool:
        """Samples shipped or failed since the last take."""
        return self._step.pending

    def shipped(self) -> None:
        if self.counts_samples:
            self._step.count(Count.SHIPPED)

    def failed(self, reason: FailureReason) -> None:
        if self.counts_samples:
            self._step.fail(reason)

    def take_from(self, senders: Sequence[MetricsSource]) -> StepData | None:
        """This step's data from the senders themselves.

        Nothing is taken, no lock and no snapshot, while their fingerprints stay as they were
        right after the last take and no sample was shipped or failed meanwhile. So an idle
        step costs a few reads."""
        if [s.metrics_mark() for s in senders] == self._fingerprints and not self.pending:
            return None
        taken = [s.take_metrics() for s in senders]
        self._fingerprints = [t.mark for t in taken]
        return self.take(taken)

    def take(self, senders: Sequence[SenderMetrics]) -> StepData | None:
        """This step's data, from each sender's metrics (counters, observations since the
        last step, samples in flight), in the order of the readers."""
        in_flight = 0
        for k, m in enumerate(senders):
            cur, obs, busy = m.stats, m.observations, m.in_flight
            prev = self._marks.get(k) or SenderStats()
            self._marks[k] = cur
            step = self._step
            if self.counts_samples:
                step.count(Count.DELIVERED, cur.requests - prev.requests)
            step.count(Count.BYTES_WRITTEN, cur.bytes - prev.bytes)
            step.count(Count.WRITES, cur.writes - prev.writes)
            step.count(Count.REWRITES, cur.rewrites - prev.rewrites)
            step.count(Count.WRITE_RETRIES, cur.write_retries - prev.write_retries)
            step.count(Count.RECONNECTS, cur.reconnects - prev.reconnects)
            step.count(Count.PLACED_AHEAD, cur.placed - prev.placed)
            step.observe(Observed.WRITE_LATENCY, obs.write_latency_s)
            step.observe(Observed.CREDIT_WAIT, obs.credit_wait_s)
            in_flight += busy
        if senders:
            self._step.level(Level.SAMPLES_IN_FLIGHT, in_flight)
        return self._step.take()


class SchedulerStats:
    """The scheduler side's step data: requests failed at admission, and the levels of its book.

    The levels are readers reachable, requests waiting for one, and blocks held for shipping."""

    def __init__(self) -> None:
        self._step = StepStats(SCHEDULER_SOURCE)
        self._waiting: set[str] = set()
        self._held: dict[str, int] = {}
        self._held_blocks = 0
        self._levels: tuple[int, int, int] | None = None

    def waiting(self, request_id: str, waits: bool) -> None:
        """The request waits in vLLM's queue for its reader (or no longer does)."""
        if waits:
            self._waiting.add(request_id)
        else:
            self._waiting.discard(request_id)

    def admission_failed(self, reason: FailureReason) -> None:
        """A request runs without shipping (its reader stayed unreachable, or its id
        cannot name a sample)."""
        self._step.fail(reason)

    def holding(self, request_id: str, num_blocks: int) -> None:
        """A finished request's blocks are held until its sample is acknowledged."""
        if request_id not in self._held:
            self._held[request_id] = num_blocks
            self._held_blocks += num_blocks

    def sent(self, request_ids: Iterable[str]) -> None:
        """vLLM frees these requests' blocks (every worker reported them sent)."""
        for rid in request_ids:
            self._held_blocks -= self._held.pop(rid, 0)

    def take(self, readers_reachable: int) -> StepData | None:
        levels = (readers_reachable, len(self._waiting), self._held_blocks)
        if levels == self._levels and not self._step.pending:
            # nothing new since the last step
            return None
        self._levels = levels
        self._step.level(Level.READERS_REACHABLE, readers_reachable)
        self._step.level(Level.REQUESTS_WAITING, len(self._waiting))
        self._step.level(Level.KV_BLOCKS_HELD, self._held_blocks)
        return self._step.take()
