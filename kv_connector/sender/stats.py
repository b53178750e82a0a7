"""Counters of one rank's sender, as typed records: what scripts, logs and metrics read
(through ``HiddenStatesSender.stats()``, which returns snapshots). Pure logic."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

from kv_connector.common.observe import Observations


@dataclass
class SenderStats:
    """One rank's sender, since it started (times in seconds, summed over requests).

    requests: acknowledged by the reader; bytes: landed by completed WRITEs (rewrites
    included); grant_wait_s: from submission to the grant; write_s: WRITEs in flight;
    ack_wait_s: from the last completed WRITE to the Ack; checksum_s: hashing shares;
    post_s: inside the transport's WRITE calls (on a shared-memory link UCX copies the
    bytes there, on the writer's thread: with ``write_s`` it tells a slow copy from a wait);
    rewrites: shares written again after the reader's checksum failed; write_retries:
    WRITEs posted again after failing in NIXL; reconnects: connections made after a
    lost one; writes: completed WRITEs; credits: runs of pages the reader granted ahead;
    placed: jobs placed in one (no credit round trip).
    """

    requests: int = 0
    bytes: int = 0
    grant_wait_s: float = 0.0
    write_s: float = 0.0
    ack_wait_s: float = 0.0
    checksum_s: float = 0.0
    post_s: float = 0.0
    rewrites: int = 0
    write_retries: int = 0
    reconnects: int = 0
    writes: int = 0
    credits: int = 0
    placed: int = 0

    def snapshot(self) -> SenderStats:
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SenderObservations(NamedTuple):
    """One sender's raw observations since they were last taken (seconds): each
    completed WRITE's latency, each grant's wait since the sample's submission."""

    write_latency_s: list[float]
    credit_wait_s: list[float]


class SenderMetrics(NamedTuple):
    """What a sender's metrics read of it at once: its counters, its observations since
    the last read, its requests in flight, and the mark of all that right after
    (``HiddenStatesSender.metrics_mark``)."""

    stats: SenderStats
    observations: SenderObservations
    in_flight: int
    mark: tuple[int, ...] = ()


class SenderMeter:
    """What one rank's job ledger counts: its ``SenderStats`` and the raw observations of
    the metrics' histograms (bounded until someone takes them). Only the ledger calls it."""

    def __init__(self) -> None:
        self.stats = SenderStats()
        self._write_latency = Observations()
        self._credit_wait = Observations()

    def granted(self, wait_s: float) -> None:
        """A job was granted pages ``wait_s`` after its submission."""
        self.stats.grant_wait_s += wait_s
        self._credit_wait.add(wait_s)

    def written(self, nbytes: int, seconds: float) -> None:
        """A WRITE of ``nbytes`` completed ``seconds`` after it was posted."""
        self.stats.write_s += seconds
        self.stats.bytes += nbytes
        self.stats.writes += 1
        self._write_latency.add(seconds)

    def posted(self, seconds: float) -> None:
        """A WRITE's post took ``seconds`` (the transport's call, whatever came of it)."""
        self.stats.post_s += seconds

    def acked(self, wait_s: float) -> None:
        """A job was finished by the reader's Ack ``wait_s`` after its last WRITE."""
        self.stats.requests += 1
        self.stats.ack_wait_s += wait_s

    def mark(self, in_flight: int) -> tuple[int, ...]:
        """The mark of what ``take`` reports (see ``SendLedger.metrics_mark``)."""
        st = self.stats
        counts = (st.requests, st.bytes, st.writes, st.rewrites, st.write_retries, st.reconnects)
        return (*counts, in_flight, len(self._write_latency) + len(self._credit_wait))

    def take(self, in_flight: int) -> SenderMetrics:
        """A snapshot of the counters, the observations since the last take, the jobs in
        flight, and the mark right after."""
        stats, obs = self.stats.snapshot(), self.take_observations()
        return SenderMetrics(stats, obs, in_flight, self.mark(in_flight))

    def take_observations(self) -> SenderObservations:
        return SenderObservations(self._write_latency.drain(), self._credit_wait.drain())
