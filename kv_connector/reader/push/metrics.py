"""The reader's Prometheus metrics, made at scrape time from its typed snapshots
(``HiddenStatesReader.stats()``, ``pool_state()``, ``producers_connected()``): nothing
is recorded for them on the data path beyond the ledger's own counters. Served by
``kv_connector.reader.push.metrics_server`` (with the file CLI's, ``files.metrics``, when it
runs).

Every name starts with ``hidden_states_reader_``; counters get ``_total`` in the text.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import NamedTuple, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kv_connector.common.observe import Histogram
from kv_connector.reader.push.stats import PoolState, ReaderStats

PREFIX = "hidden_states_reader_"


class RefusalReason(enum.Enum):
    """Why the reader refused a sample (it is never handed out)."""

    # larger than the whole pool
    POOL_TOO_SMALL = "pool_too_small"
    # a share failed its checksum after every rewrite
    CHECKSUM = "checksum"
    # more tokens than max_sample_tokens
    LIMIT = "limit"
    # a share came without the checksum this reader requires
    UNCHECKED = "unchecked"
    # not complete sample_timeout_s after its pages were granted
    TIMEOUT = "timeout"
    # not the layer ids, dtype, hidden size or model the reader expects
    MISMATCH = "mismatch"


class PageState(enum.Enum):
    FREE = "free"
    GRANTED = "granted"
    LEASED = "leased"
    QUARANTINED = "quarantined"


class Spec(NamedTuple):
    name: str
    doc: str


SAMPLES = Spec(PREFIX + "samples_received", "Samples handed out (complete and checked), by producer.")
TOKENS = Spec(PREFIX + "tokens_received", "Tokens of the samples handed out, by producer.")
BYTES = Spec(PREFIX + "received_bytes", "Bytes of hidden_states handed out, by producer.")
POOL_PAGES = Spec(PREFIX + "pool_pages", "Receive pool pages by state (free, granted, leased, quarantined).")
PAGE_BYTES = Spec(PREFIX + "pool_page_bytes", "Size of one receive pool page.")
WAITING = Spec(PREFIX + "samples_waiting_for_pages", "Samples whose producers wait for a run of pages.")
CHECKSUM_FAILURES = Spec(PREFIX + "checksum_failures", "Shares that did not match their checksum.")
REFUSED = Spec(PREFIX + "samples_refused", "Samples refused, by reason (never handed out).")
DROPPED = Spec(
    PREFIX + "samples_dropped",
    "Samples dropped before hand-out: refused after their rewrites, or their producer gone or gave up.",
)
CONNECTIONS_REFUSED = Spec(
    PREFIX + "connections_refused", "Producer connections refused (handshake or protocol errors)."
)
RESENDS = Spec(
    PREFIX + "resends_acked", "Resends of samples already delivered, acknowledged, not delivered again."
)
HANDOUT = Spec(
    PREFIX + "handout_latency_seconds",
    "From a sample's first credit request to its hand-out (pages, transfer, check, the user's get).",
)
PRODUCERS = Spec(PREFIX + "producers_connected", "Producers with at least one rank connected.")
RANKS = Spec(PREFIX + "producer_ranks_connected", "Ranks connected, by producer.")
ALL = (
    SAMPLES,
    TOKENS,
    BYTES,
    POOL_PAGES,
    PAGE_BYTES,
    WAITING,
    CHECKSUM_FAILURES,
    REFUSED,
    DROPPED,
    CONNECTIONS_REFUSED,
    RESENDS,
    HANDOUT,
    PRODUCERS,
    RANKS,
)


def histogram_family(spec: Spec, histogram: Histogram) -> HistogramMetricFamily:
    buckets = [("+Inf" if le == float("inf") else repr(le), n) for le, n in histogram.cumulative()]
    return HistogramMetricFamily(spec.name, spec.doc, buckets=buckets, sum_value=histogram.total)


def reader_families(stats: ReaderStats, pool: PoolState, producers: Mapping[str, int]) -> list[Metric]:
    """The reader's metrics from its snapshots."""
    out: list[Metric] = []
    for spec, field in ((SAMPLES, "samples"), (TOKENS, "tokens"), (BYTES, "bytes")):
        c = CounterMetricFamily(spec.name, spec.doc, labels=["producer"])
        for pid, totals in sorted(stats.by_producer.items()):
            c.add_metric([pid], getattr(totals, field))
        out.append(c)
    pages = GaugeMetricFamily(POOL_PAGES.name, POOL_PAGES.doc, labels=["state"])
    for state, n in (
        (PageState.FREE, pool.free),
        (PageState.GRANTED, pool.granted),
        (PageState.LEASED, pool.leased),
        (PageState.QUARANTINED, pool.quarantined),
    ):
        pages.add_metric([state.value], n)
    out += [
        pages,
        GaugeMetricFamily(PAGE_BYTES.name, PAGE_BYTES.doc, value=pool.page_bytes),
        GaugeMetricFamily(WAITING.name, WAITING.doc, value=pool.waiting),
        CounterMetricFamily(CHECKSUM_FAILURES.name, CHECKSUM_FAILURES.doc, value=stats.checksum_mismatches),
    ]
    refused = CounterMetricFamily(REFUSED.name, REFUSED.doc, labels=["reason"])
    by_reason = {
        RefusalReason.POOL_TOO_SMALL: stats.refused_pool_too_small,
        RefusalReason.CHECKSUM: stats.refused_checksum,
        RefusalReason.LIMIT: stats.refused_limit,
        RefusalReason.UNCHECKED: stats.refused_unchecked,
        RefusalReason.TIMEOUT: stats.refused_timeout,
        RefusalReason.MISMATCH: stats.refused_mismatch,
    }
    for reason, n in by_reason.items():
        refused.add_metric([reason.value], n)
    connections = stats.refused - sum(by_reason.values())
    out += [
        refused,
        CounterMetricFamily(DROPPED.name, DROPPED.doc, value=stats.dropped),
        CounterMetricFamily(CONNECTIONS_REFUSED.name, CONNECTIONS_REFUSED.doc, value=connections),
        CounterMetricFamily(RESENDS.name, RESENDS.doc, value=stats.resends_acked),
        histogram_family(HANDOUT, stats.handout_latency),
        GaugeMetricFamily(PRODUCERS.name, PRODUCERS.doc, value=len(producers)),
    ]
    ranks = GaugeMetricFamily(RANKS.name, RANKS.doc, labels=["producer"])
    for pid, n in sorted(producers.items()):
        ranks.add_metric([pid], n)
    out.append(ranks)
    return out


class ReaderView(Protocol):
    """What the metrics read of a reader (``HiddenStatesReader``)."""

    def stats(self) -> ReaderStats: ...

    def pool_state(self) -> PoolState: ...

    def producers_connected(self) -> dict[str, int]: ...


class ReaderCollector(Collector):
    """Collects a reader's metrics at each scrape."""

    def __init__(self, reader: ReaderView) -> None:
        self._reader = reader

    def collect(self) -> Iterable[Metric]:
        r = self._reader
        return reader_families(r.stats(), r.pool_state(), r.producers_connected())
