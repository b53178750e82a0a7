"""Ratios that hold on a noisy machine: two arms run back to back, in alternating order
(A B, B A, A B, ...), after a warm-up pair that is not counted; each pair gives one ratio,
and a figure is the median of those ratios with their min and max.

An arm is anything that runs one measurement and returns a ``Run``: how long it took, how
much it moved (bytes, and the unit its rate is counted in: tokens, rows) and the CPU
seconds every process of the arm spent on it (both ends, from their own rusage). Arms are
long-lived (processes started once, a round on command), so a pair costs the work, not the
start-up, and many pairs fit in a few minutes.

Pure logic apart from the clock the arms use; no vllm, nixl or torch.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Run:
    """One measurement of one arm."""

    seconds: float
    units: float  # what the arm's rate counts: tokens, rows
    nbytes: float = 0.0  # bytes moved, where the arm moves bytes
    cpu_s: float = 0.0  # CPU seconds (user + system) of every process of the arm
    detail: Mapping[str, float] = field(default_factory=dict)  # the arm's own breakdown

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError(f"a run must take time, got {self.seconds} s")

    @property
    def rate(self) -> float:
        return self.units / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def cpu_s_per_gb(self) -> float:
        if self.nbytes <= 0:
            raise ValueError("this arm moves no bytes")
        return self.cpu_s / (self.nbytes / 1e9)


@dataclass(frozen=True)
class Spread:
    """The median of per-pair values, with the smallest and largest."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            raise ValueError("no values")
        return cls(statistics.median(values), min(values), max(values), tuple(values))

    def rounded(self, digits: int = 3) -> tuple[float, list[float]]:
        return round(self.median, digits), [round(self.low, digits), round(self.high, digits)]


@dataclass
class Pairs:
    """The runs of two arms, pair by pair."""

    a: list[Run] = field(default_factory=list)
    b: list[Run] = field(default_factory=list)

    def ratio(self, value: Callable[[Run], float] = lambda r: r.rate) -> Spread:
        """value(a) / value(b), one per pair."""
        return Spread.of([value(x) / value(y) for x, y in zip(self.a, self.b, strict=True)])

    def each(self, side: str, value: Callable[[Run], float] = lambda r: r.rate) -> Spread:
        runs = self.a if side == "a" else self.b
        return Spread.of([value(r) for r in runs])


def run_pairs(a: Callable[[], Run], b: Callable[[], Run], pairs: int = 5, warmup: int = 1) -> Pairs:
    """``warmup`` uncounted pairs, then ``pairs`` pairs, the order alternating: the first
    counted pair runs A then B, the next B then A, and so on."""
    if pairs < 1:
        raise ValueError("at least one pair")
    for _ in range(warmup):
        a()
        b()
    out = Pairs()
    for k in range(pairs):
        if k % 2 == 0:
            out.a.append(a())
            out.b.append(b())
        else:
            out.b.append(b())
            out.a.append(a())
    return out


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def memory_mib() -> dict[str, float]:
    """This process's resident memory now, by kind (Linux's /proc/self/status): anonymous
    (its own heap, its buffers), file-backed (the shared libraries' pages it touched, which
    every process using the same libraries shares) and shared memory; and the peak."""
    out: dict[str, float] = {}
    names = {"VmHWM": "peak", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in names:
            out[names[key]] = int(value.split()[0]) / 1024
    return out


def machine_state() -> dict[str, object]:
    """The CPU kind, the cores this process may use and the load average: printed at the
    start and the end of a benchmark, since a shared machine's load moves its figures."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    model = platform.processor() or platform.machine()
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = line
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    words = set(flags.split())
    if "amx_tile" in words:
        isa = "AVX-512 + AMX"
    elif "avx512_bf16" in words:
        isa = "AVX-512 BF16"
    elif "avx512f" in words:
        isa = "AVX-512"
    elif "avx2" in words:
        isa = "AVX2"
    else:
        isa = platform.machine()
    return {
        "cpu": model,
        "isa": isa,
        "cores": len(os.sched_getaffinity(0)),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
