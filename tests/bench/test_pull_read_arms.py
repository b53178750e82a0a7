"""``scripts.bench.pull.read``'s ``pull_read_over_raw`` arms at a tiny size (real producer and
consumer processes, real NIXL): each round moves the bytes it claims, byte-exact against
the producer's cache (the pull arm through ``PullClient``, the raw arm with plain READs),
a pull round leaves nothing held, both with the integrity checks on and off, and both
processes are gone afterwards. The figures themselves are ``python -m scripts.bench.pull``'s."""

from __future__ import annotations

import pytest

from scripts.bench.pull.read import PullVsRaw, bench_read
from scripts.bench.pull.shape import BLOCK, LAYER_IDS

pytestmark = pytest.mark.integration

HIDDEN = 256
TOKENS = 3 * BLOCK - 5  # a partly filled last block
SAMPLES = 3


@pytest.mark.parametrize("checks", [True, False])
def test_both_arms_read_every_byte_of_the_cache(checks: bool) -> None:
    block_bytes = BLOCK * len(LAYER_IDS) * HIDDEN * 2
    b = PullVsRaw(samples=SAMPLES, tokens=TOKENS, hidden=HIDDEN, in_flight=2, verify=True, checks=checks)
    try:
        assert len(b.expected) == SAMPLES  # each sample's bytes, from the producer's cache
        arms = (b.pull, b.raw, b.raw, b.pull, b.raw_checked)  # digests compared inside
        runs = [arm() for arm in arms]
    finally:
        b.close()
    for run in runs:
        assert run.nbytes == SAMPLES * 3 * block_bytes  # whole blocks READ, as both arms do
        assert run.units == SAMPLES * TOKENS and run.seconds > 0 and run.cpu_s > 0
    assert [len(b.cpu[arm]["consumer"]) for arm in ("pull", "raw", "raw_checked")] == [2, 2, 1]
    assert not b.producer.proc.is_alive()
    assert b.consumer is not None and not b.consumer.proc.is_alive()


def test_the_read_figure_comes_from_pairs() -> None:
    out = bench_read(pairs=1, warmup=0, samples=2, tokens=TOKENS, hidden=HIDDEN, in_flight=2)
    assert out["pull_read_over_raw"] > 0 and out["range"][0] <= out["pull_read_over_raw"] <= out["range"][1]
    ceiling = out["checked_raw_over_raw"]  # raw READs with the client's checks, over plain ones
    assert ceiling > 0 and out["checked_raw_range"][0] <= ceiling <= out["checked_raw_range"][1]
    for arm in ("pull", "raw"):
        assert out[arm]["GB_per_s"]["median"] > 0
        assert set(out[arm]["cpu_s_per_GB"]) == {"consumer", "producer"}
