"""Counters of the reader, as typed records: what scripts, logs and metrics read
(through ``HiddenStatesReader.stats()``, which returns snapshots). Pure logic."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kv_connector.common.observe import WAIT_BUCKETS_S, Histogram


@dataclass
class ProducerTotals:
    """What a reader handed out of one producer's samples."""

    samples: int = 0
    tokens: int = 0
    bytes: int = 0


@dataclass
class ReaderStats:
    """The reader's counts and times since it started.

    samples / tokens / bytes: handed out, in all and ``by_producer``; bytes are of
    ``hidden_states``. refused: connections and samples refused. Of those samples:
    ``refused_pool_too_small``, ``refused_checksum``, ``refused_limit`` (over
    ``max_sample_tokens``), ``refused_unchecked`` (a required checksum missing),
    ``refused_timeout`` (not complete by its deadline) and ``refused_mismatch`` (not what
    ``expect`` says). dropped: samples discarded before hand-out, refused after their rewrites or
    whose producer is gone or gave up. copy_s: copying samples out of the pool. verify_s:
    checking shares, with the values screen of a host pool's fingerprinted rows.
    checksum_mismatches: shares that failed. resends_acked: resends of delivered samples,
    acknowledged without a copy. handout_latency: from a sample's first credit request to its
    hand-out. first_request_t / last_handout_t: the run's active window in ``time.monotonic()``,
    0.0 until it happens. peak_pages_used: the most pool pages held at once. values_check_s:
    checking states for NaN/Inf and all-zero tokens at hand-out.
    """

    samples: int = 0
    bytes: int = 0
    refused: int = 0
    copy_s: float = 0.0
    verify_s: float = 0.0
    checksum_mismatches: int = 0
    resends_acked: int = 0
    tokens: int = 0
    refused_pool_too_small: int = 0
    refused_checksum: int = 0
    refused_limit: int = 0
    refused_unchecked: int = 0
    refused_timeout: int = 0
    refused_mismatch: int = 0
    dropped: int = 0
    values_check_s: float = 0.0
    first_request_t: float = 0.0
    last_handout_t: float = 0.0
    peak_pages_used: int = 0
    by_producer: dict[str, ProducerTotals] = field(default_factory=dict)
    handout_latency: Histogram = field(default_factory=lambda: Histogram(WAIT_BUCKETS_S))

    @property
    def samples_refused(self) -> int:
        """Samples refused (never handed out), whatever the reason."""
        return (
            self.refused_pool_too_small
            + self.refused_checksum
            + self.refused_limit
            + self.refused_unchecked
            + self.refused_timeout
            + self.refused_mismatch
        )

    def handed_out(self, producer_id: str, tokens: int, nbytes: int, latency_s: float, now: float) -> None:
        """Count a sample handed out (its ledger does, as it hands it out)."""
        self.samples += 1
        self.bytes += nbytes
        self.tokens += tokens
        mine = self.by_producer.get(producer_id)
        if mine is None:
            mine = self.by_producer[producer_id] = ProducerTotals()
        mine.samples += 1
        mine.tokens += tokens
        mine.bytes += nbytes
        self.handout_latency.observe(latency_s)
        self.last_handout_t = now

    def snapshot(self) -> ReaderStats:
        return dataclasses.replace(
            self,
            by_producer={k: dataclasses.replace(v) for k, v in self.by_producer.items()},
            handout_latency=self.handout_latency.snapshot(),
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PoolState:
    """The reader's receive pool now, in pages of ``page_bytes``; 0 before the first producer sets it.

    ``free`` + ``granted`` + ``leased`` + ``quarantined`` = ``num_pages``. granted: held by
    samples on their way, up to their ``get``, and by credits ahead (R12). leased: held by
    samples on lease to the user. quarantined: of discarded samples, for a few seconds.
    waiting: samples waiting for a run of pages, whose producers wait too.
    """

    page_bytes: int = 0
    num_pages: int = 0
    free: int = 0
    granted: int = 0
    leased: int = 0
    quarantined: int = 0
    waiting: int = 0
