"""Counters of one rank's sender, as typed records: what scripts, logs and metrics read
(through ``HiddenStatesSender.stats()``, which returns snapshots). Pure logic."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass
class SenderStats:
    """One rank's sender, since it started (times in seconds, summed over requests).

    requests: acknowledged by the reader; bytes: landed by completed WRITEs (rewrites
    included); grant_wait_s: from submission to the grant; write_s: WRITEs in flight;
    ack_wait_s: from the last completed WRITE to the Ack; checksum_s: hashing shares;
    rewrites: shares written again after the reader's checksum failed; write_retries:
    WRITEs posted again after failing in NIXL; reconnects: connections made after a
    lost one; writes: completed WRITEs.
    """

    requests: int = 0
    bytes: int = 0
    grant_wait_s: float = 0.0
    write_s: float = 0.0
    ack_wait_s: float = 0.0
    checksum_s: float = 0.0
    rewrites: int = 0
    write_retries: int = 0
    reconnects: int = 0
    writes: int = 0

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
    the last read, its requests in flight, and the fingerprint of all that right after
    (``HiddenStatesSender.metrics_mark``)."""

    stats: SenderStats
    observations: SenderObservations
    in_flight: int
    mark: tuple[int, ...] = ()
