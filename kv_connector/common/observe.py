"""Observations for metrics that cost nothing measurable on the data path: histograms
with fixed buckets, counted in place, and bounded buffers of raw values that a reporter
drains now and then. Pure logic (no clocks, threads or I/O; the caller locks)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_connector.common.errors import ConfigurationError

# bucket upper bounds in seconds, for waits from a fraction of a millisecond to minutes
WAIT_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0,
)
# for operations of a few microseconds to a few seconds (a WRITE, an fsync)
OPERATION_BUCKETS_S: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)

# raw values kept between two drains; more are counted, not kept
OBSERVATIONS_LIMIT = 10_000


@dataclass
class Histogram:
    """Counts of observed values per bucket, Prometheus' way: a value falls in the first
    bucket whose upper bound is >= it; ``counts[-1]`` is the +Inf bucket."""

    bounds: tuple[float, ...] = WAIT_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ConfigurationError("histogram bounds must increase strictly")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        elif len(self.counts) != len(self.bounds) + 1:
            raise ConfigurationError(f"{len(self.counts)} counts for {len(self.bounds)} bounds")

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, values <= it) for every bucket, +Inf last."""
        out, n = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            n += c
            out.append((bound, n))
        return out

    def snapshot(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total, self.count)


class Observations:
    """Raw values (seconds) between two ``drain`` calls, at most ``limit`` kept: a
    reporter that never drains costs a bounded list; values past the limit are counted
    in ``dropped`` (the next drain reports them)."""

    __slots__ = ("_values", "dropped", "limit")

    def __init__(self, limit: int = OBSERVATIONS_LIMIT) -> None:
        if limit <= 0:
            raise ConfigurationError(f"limit must be positive, got {limit}")
        self.limit = limit
        self._values: list[float] = []
        self.dropped = 0

    def add(self, value: float) -> None:
        if len(self._values) < self.limit:
            self._values.append(float(value))
        else:
            self.dropped += 1

    def __len__(self) -> int:
        return len(self._values)

    def drain(self) -> list[float]:
        """The values since the last drain (and forget them, and the dropped count)."""
        out, self._values = self._values, []
        self.dropped = 0
        return out


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest rank; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]
