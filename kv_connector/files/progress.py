"""The reader's progress on a terminal: one line of rates (samples, tokens/s, GB/s, pool
use, producers) from periodic readings of the reader, and a summary of the whole run.
Pure logic (times are passed in; the shell, ``reader.console``, prints)."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from kv_connector.common.errors import ConfigurationError
from kv_connector.files.stats import FileStats
from kv_connector.reader import PoolState, ReaderStats

# the live line's rates: over its last seconds
RATE_WINDOW_S = 5.0


@dataclass(frozen=True)
class Reading:
    """One look at a reader at time ``t`` (seconds, any monotonic clock)."""

    t: float
    samples: int
    tokens: int
    bytes: int
    pool: PoolState
    producers: int
    files: int = 0


def si(value: float) -> str:
    """1234 -> "1.2k", 2500000 -> "2.5M"; below 1000 as an integer."""
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.1f}{unit}"
    return f"{value:.0f}"


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, sec = divmod(round(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m{sec:02d}s" if m >= 60 else f"{m}m{sec:02d}s"


def pool_use(pool: PoolState) -> float | None:
    """The share of the pool's pages not free (0..1); None before it has pages."""
    if pool.num_pages <= 0:
        return None
    return (pool.num_pages - pool.free) / pool.num_pages


class RateWindow:
    """Rates over the last ``window_s`` seconds of readings, and the run's extremes."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        if window_s <= 0:
            raise ConfigurationError("window_s must be positive")
        self.window_s = window_s
        self._recent: collections.deque[Reading] = collections.deque()
        self.first: Reading | None = None
        self.last: Reading | None = None
        self.peak_pool_use = 0.0

    def add(self, reading: Reading) -> None:
        if self.first is None:
            self.first = reading
        self.last = reading
        self._recent.append(reading)
        # keep one reading at or before the window's start as the rates' base
        while len(self._recent) > 2 and self._recent[1].t <= reading.t - self.window_s:
            self._recent.popleft()
        use = pool_use(reading.pool)
        if use is not None:
            self.peak_pool_use = max(self.peak_pool_use, use)

    def measured(self) -> bool:
        """Whether the window holds a time span to take rates over."""
        return len(self._recent) >= 2 and self._recent[-1].t > self._recent[0].t

    def rates(self) -> tuple[float, float, float]:
        """(samples/s, tokens/s, bytes/s) over the window; zeros until it is ``measured()``."""
        if not self.measured():
            return 0.0, 0.0, 0.0
        a, b = self._recent[0], self._recent[-1]
        dt = b.t - a.t
        return (b.samples - a.samples) / dt, (b.tokens - a.tokens) / dt, (b.bytes - a.bytes) / dt

    def line(self) -> str:
        """``1,234 samples | 45.6k tok/s | 1.23 GB/s | pool 37% (2 waiting) | 2 producers``; the
        rates appear once there are two readings to take them over."""
        r = self.last
        if r is None:
            return "waiting for producers"
        use = pool_use(r.pool)
        pool = "pool -" if use is None else f"pool {100 * use:.0f}%"
        if r.pool.waiting:
            pool += f" ({r.pool.waiting} waiting)"
        parts = [f"{r.samples:,} samples"]
        # no rate before two readings: a 0.00 there would mean nothing
        if self.measured():
            _, tok_s, byte_s = self.rates()
            parts += [f"{si(tok_s)} tok/s", f"{byte_s / 1e9:.2f} GB/s"]
        parts += [pool, f"{r.producers} producer{'' if r.producers == 1 else 's'}"]
        if r.files:
            parts.append(f"{r.files:,} files")
        return " | ".join(parts)

    def peak_use(self, stats: ReaderStats) -> float:
        """The most of the pool ever in use: the reader's own peak, or the readings'."""
        pages = self.last.pool.num_pages if self.last is not None else 0
        return max(self.peak_pool_use, stats.peak_pages_used / pages if pages else 0.0)

    def summary(self, stats: ReaderStats, files: FileStats | None = None) -> str:
        """The run in one paragraph: totals, average rates (over the reader's active
        window: its first credit request to its last hand-out), peak pool use, trouble."""
        elapsed = max(0.0, stats.last_handout_t - stats.first_request_t) if stats.last_handout_t else 0.0

        def per_s(amount: float) -> float:
            return amount / elapsed if elapsed > 0 else 0.0

        text = (
            f"received {stats.samples:,} samples, {stats.tokens:,} tokens, {stats.bytes / 1e9:.3f} GB "
            f"in {duration(elapsed)} ({si(per_s(stats.tokens))} tok/s, {per_s(stats.bytes) / 1e9:.2f} GB/s); "
            f"pool at most {100 * self.peak_use(stats):.0f}% used; "
            f"{stats.checksum_mismatches} checksum failures, "
            f"{stats.samples_refused} samples refused, "
            f"{stats.dropped} dropped"
        )
        if files is not None:
            text += (
                f"; {files.files:,} files written ({files.bytes / 1e9:.3f} GB), "
                f"fsync {duration(files.fsync.total)} in all"
            )
        return text
