"""``pull_read_over_raw`` (and its ceiling ``checked_raw_over_raw``): the pull client's
fetches over raw NIXL READs of the same blocks, between one producer process
(``read_producer``) and one consumer process (``read_consumer``), in pairs."""

from __future__ import annotations

import statistics
import time
from typing import Any

from scripts.bench import paired
from scripts.bench.pull.child import Child
from scripts.bench.pull.read_consumer import consumer_proc
from scripts.bench.pull.read_producer import producer_proc
from scripts.bench.pull.shape import (
    BLOCK,
    HIDDEN,
    IN_FLIGHT,
    LAYER_IDS,
    PAIRS,
    SAMPLES,
    TOKENS,
    WARMUP,
    log,
    spread,
)

RELEASE_WAIT_S = 10.0  # a release lost would leave its sample held until its timeout


class PullVsRaw:
    """The two arms of ``pull_read_over_raw`` over one producer and one consumer process.
    ``verify``: every round also compares each sample's bytes with the producer's cache
    (slow; for tests)."""

    def __init__(
        self,
        samples: int = SAMPLES,
        tokens: int = TOKENS,
        hidden: int = HIDDEN,
        in_flight: int = IN_FLIGHT,
        verify: bool = False,
        seed: int = 5,
        checks: bool = True,
    ) -> None:
        self.tokens, self.verify = tokens, verify
        sample_bytes = -(-tokens // BLOCK) * BLOCK * len(LAYER_IDS) * hidden * 2
        self.pool_bytes = in_flight * sample_bytes
        self.producer = Child(producer_proc, samples, tokens, hidden, seed, checks)
        self.consumer: Child | None = None
        try:
            self.info = self.producer.call("info")
            self.consumer = Child(consumer_proc, self.pool_bytes, in_flight, checks)
            self.consumer.call("setup", self.info)
            self.expected = self.producer.call("digests") if verify else []
        except BaseException:
            self.close()
            raise
        arms = ("pull", "raw", "raw_checked")
        self.cpu: dict[str, dict[str, list[float]]] = {arm: {"producer": [], "consumer": []} for arm in arms}
        self.gb: dict[str, list[float]] = {arm: [] for arm in arms}

    def _record(self, arm: str, secs: float, nbytes: int, ccpu: float, pcpu: float) -> paired.Run:
        self.cpu[arm]["consumer"].append(ccpu)
        self.cpu[arm]["producer"].append(pcpu)
        run = paired.Run(secs, self.tokens * len(self.info["blocks"]), float(nbytes), ccpu + pcpu)
        self.gb[arm].append(nbytes / 1e9)
        return run

    def pull(self) -> paired.Run:
        assert self.consumer is not None
        handles = self.producer.call("hold")
        p0 = self.producer.call("cpu")
        secs, nbytes, ccpu, digests = self.consumer.call("pull", handles, self.verify)
        p1 = self.producer.call("cpu")
        # the last releases are one-way (fenced reads): the server takes them when they come
        deadline = time.monotonic() + RELEASE_WAIT_S
        while (held := self.producer.call("poll")[1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        if held:
            raise RuntimeError(f"the producer still holds {held} samples {RELEASE_WAIT_S} s after the round")
        if self.verify and digests != self.expected:
            raise RuntimeError("fetched bytes differ from the producer's cache")
        return self._record("pull", secs, nbytes, ccpu, p1 - p0)

    def raw(self, checks: bool = False) -> paired.Run:
        """Plain READs; with ``checks`` (the ceiling arm), the consumer checks each sample
        as the client does by default (fingerprint, sampled values screen) on a thread of
        its own, its slot read into again only after."""
        assert self.consumer is not None
        self.producer.call("raw", True)
        try:
            p0 = self.producer.call("cpu")
            secs, nbytes, ccpu, digests = self.consumer.call(
                "raw", self.info["blocks"], self.tokens, self.verify, checks
            )
            p1 = self.producer.call("cpu")
        finally:
            self.producer.call("raw", False)
        if self.verify and digests != self.expected:
            raise RuntimeError("raw READ bytes differ from the producer's cache")
        return self._record("raw_checked" if checks else "raw", secs, nbytes, ccpu, p1 - p0)

    def raw_checked(self) -> paired.Run:
        return self.raw(checks=True)

    def arm(self, name: str, runs: list[paired.Run]) -> dict[str, Any]:
        """An arm's GB/s and both processes' CPU seconds per GB over its counted ``runs``."""
        n = len(runs)
        cpu = {
            who: spread([c / (r.nbytes / 1e9) for c, r in zip(self.cpu[name][who][-n:], runs, strict=True)])
            for who in ("consumer", "producer")
        }
        return {
            "GB_per_s": spread([r.gb_per_s for r in runs]),
            "cpu_s_per_GB": cpu,
            "GB_per_round": round(runs[0].nbytes / 1e9, 3),
        }

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.stop()
        self.producer.stop()


def bench_read(pairs: int = PAIRS, warmup: int = WARMUP, **kw: Any) -> dict[str, Any]:
    """The pull arm over the raw arm and, with the checks on, the checked raw arm over the
    raw arm (the ceiling), in ``pairs`` pairs after ``warmup``; ``kw`` go to ``PullVsRaw``."""
    b = PullVsRaw(**kw)
    checks_on = kw.get("checks", True)
    try:
        n = len(b.info["blocks"])
        checks = "on" if checks_on else "off (no checksum, no values check)"
        log(f"pull vs raw READ: {n} samples of {b.tokens} tokens per round, checks {checks}")
        p = paired.run_pairs(b.pull, b.raw, pairs=pairs, warmup=warmup)
        # the machine's ceiling: raw READs with the same checks at both ends, no protocol
        c = paired.run_pairs(b.raw_checked, b.raw, pairs=pairs, warmup=warmup) if checks_on else None
        assert b.consumer is not None
        prof = b.consumer.call("profile", b.tokens, kw.get("hidden", HIDDEN))
    finally:
        b.close()
    med, rng = p.ratio(lambda r: r.gb_per_s).rounded()
    ceiling = c.ratio(lambda r: r.gb_per_s).rounded() if c is not None else None
    return {
        "pull_read_over_raw": med,
        "range": rng,
        "checked_raw_over_raw": ceiling[0] if ceiling else None,
        "checked_raw_range": ceiling[1] if ceiling else None,
        "pull": b.arm("pull", p.a),
        "raw": b.arm("raw", p.b),
        "samples_per_round": n,
        "sample_MiB": round(p.a[0].nbytes / n / (1 << 20), 1),
        "in_flight": kw.get("in_flight", IN_FLIGHT),
        "checks": checks_on,
        "ms_per_sample": {
            "pull": round(statistics.median(r.seconds for r in p.a) / n * 1e3, 2),
            "raw": round(statistics.median(r.seconds for r in p.b) / n * 1e3, 2),
            **prof,
        },
        "layout": f"TLH (GPU), bf16, 4 layers x hidden {kw.get('hidden', HIDDEN)}, block {BLOCK}",
    }
