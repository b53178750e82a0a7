"""Real NIXL WRITEs from sender processes into the reader: byte-exact samples, scattered
blocks, credits that throttle, pieces smaller than blocks, and ranks that share samples."""

from __future__ import annotations

import random
import subprocess
from typing import Any

import pytest

from kv_connector.reader import HiddenStatesReader, Sample
from kv_connector.wire.layout import BlockLayout
from tests.integration.common import (
    expected_states,
    finish_sender,
    layout_dict,
    make_cache,
    same_bytes,
    start_sender,
    token_ids,
)

pytestmark = pytest.mark.integration

NUM_CACHE_BLOCKS = 64
CPU_LAYOUT = BlockLayout("LTH", 16, 3, 64, "float32")
GPU_LAYOUT = BlockLayout("TLH", 16, 4, 96, "bfloat16")


def plan(sizes: list[int], seed: int, layout: BlockLayout) -> list[dict[str, Any]]:
    """Samples of the given token counts on scattered, shuffled cache blocks."""
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(sizes):
        nb = -(-n // layout.block_size)
        out.append(
            {
                "request_id": f"s{seed}-{i}",
                "num_tokens": n,
                "block_ids": rng.sample(range(NUM_CACHE_BLOCKS), nb),
            }
        )
    return out


def check(
    samples: dict[str, Sample],
    spec_samples: list[dict[str, Any]],
    layout: BlockLayout,
    seed: int,
    pad_bytes: int = 0,
) -> None:
    cache = make_cache(layout, NUM_CACHE_BLOCKS, seed, pad_bytes=pad_bytes)
    assert set(samples) == {s["request_id"] for s in spec_samples}
    for s in spec_samples:
        got = samples[s["request_id"]]
        assert got.token_ids.tolist() == token_ids(s["request_id"], s["num_tokens"])
        assert got.hidden_states.shape == (s["num_tokens"], layout.num_layers, layout.hidden_size)
        assert same_bytes(got.hidden_states, expected_states(cache, layout, s["block_ids"], s["num_tokens"]))


def ship(
    reader: HiddenStatesReader, layout: BlockLayout, seed: int, samples: list[dict[str, Any]], **extra: Any
) -> subprocess.Popen[str]:
    """A sender process shipping ``samples`` from the deterministic cache of ``seed``."""
    return start_sender(
        dict(
            address=reader.address,
            layout=layout_dict(layout),
            num_cache_blocks=NUM_CACHE_BLOCKS,
            seed=seed,
            samples=samples,
            **extra,
        )
    )


def collect(reader: HiddenStatesReader, n: int, timeout: float = 60) -> dict[str, Sample]:
    got: dict[str, Sample] = {}
    for _ in range(n):
        s = reader.get(timeout=timeout, copy=True)  # kept for the checks: a copy
        assert s.request_id not in got, f"{s.request_id} delivered twice"
        got[s.request_id] = s
    return got


@pytest.mark.parametrize("layout", [CPU_LAYOUT, GPU_LAYOUT], ids=["cpu-LTH-fp32", "gpu-TLH-bf16"])
def test_samples_of_every_boundary_size_arrive_byte_exact(layout: BlockLayout) -> None:
    bs = layout.block_size
    samples = plan([1, bs, bs + 1, 7 * bs + 5, 2 * bs - 1], seed=1, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        proc = ship(reader, layout, 1, samples)
        got = collect(reader, len(samples))
        res = finish_sender(proc)
    assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    check(got, samples, layout, seed=1)
    assert all(s.layer_ids == tuple(range(layout.num_layers)) for s in got.values())


@pytest.mark.parametrize(
    ("layout", "pad_bytes", "digests"),
    [
        (CPU_LAYOUT, 4096, False),
        (GPU_LAYOUT, 1000, True),
        # gpt-oss-like: 1-token blocks in pages padded past their data
        (BlockLayout("TLH", 1, 4, 96, "bfloat16"), 4 * 96 * 2 // 3, True),
    ],
    ids=["cpu-LTH-fp32", "gpu-TLH-bf16", "tlh-1-token-blocks"],
)
def test_blocks_in_padded_pages_arrive_without_their_padding(
    layout: BlockLayout, pad_bytes: int, digests: bool
) -> None:
    """vLLM pads the hidden-state group's page to the other groups' when a model mixes
    kinds of layer and the design cannot lend it a block table: blocks lie a page apart,
    more than one block; the samples carry their data, byte-exact, checked end to end."""
    bs = layout.block_size
    samples = plan([1, bs, bs + 1, 7 * bs + 5, 2 * bs - 1, 40], seed=3, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        # XXH3 through the staging path a GPU cache takes, or block digests
        proc = ship(
            reader, layout, 3, samples, pad_bytes=pad_bytes, block_digests=digests, stage_checksum=not digests
        )
        got = collect(reader, len(samples))
        res = finish_sender(proc)
    assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    check(got, samples, layout, seed=3, pad_bytes=pad_bytes)


def test_more_samples_than_the_pool_holds_are_throttled_not_lost() -> None:
    layout = CPU_LAYOUT
    rng = random.Random(5)
    samples = plan([rng.randint(1, 4 * layout.block_size) for _ in range(40)], seed=2, layout=layout)
    # Four blocks of room: at most a sample or two in flight at a time.
    with HiddenStatesReader(pool_bytes=4 * layout.block_bytes) as reader:
        proc = ship(reader, layout, 2, samples)
        got = collect(reader, len(samples))
        res = finish_sender(proc)
        assert reader.stats().samples == len(samples)
    assert res["rc"] == 0 and sorted(res["finished"]) == sorted(s["request_id"] for s in samples)
    check(got, samples, layout, seed=2)


def test_blocks_larger_than_pages_travel_in_pieces() -> None:
    layout = CPU_LAYOUT
    samples = plan([1, 33, 100], seed=3, layout=layout)
    page = layout.block_bytes // 3 + 100  # three pieces per block, the last one short
    with HiddenStatesReader(pool_bytes=40 * page, page_bytes=page) as reader:
        proc = ship(reader, layout, 3, samples)
        got = collect(reader, len(samples))
        res = finish_sender(proc)
    assert res["rc"] == 0, res["stderr"][-3000:]
    check(got, samples, layout, seed=3)


def test_two_ranks_each_write_their_share_of_every_sample() -> None:
    layout = GPU_LAYOUT
    samples = plan([1, 16, 17, 80, 47], seed=4, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        procs = [
            start_sender(
                dict(
                    address=reader.address,
                    producer_id="tp",
                    rank=r,
                    world_size=2,
                    layout=layout_dict(layout),
                    num_cache_blocks=NUM_CACHE_BLOCKS,
                    seed=4,
                    samples=samples,
                )
            )
            for r in range(2)
        ]
        got = collect(reader, len(samples))
        results = [finish_sender(p) for p in procs]
    for res in results:
        assert res["rc"] == 0, res["stderr"][-3000:]
    # Rank 0 writes ceil(n/2) blocks, rank 1 the rest: both links carry bytes.
    assert results[0]["stats"]["bytes"] > 0 and results[1]["stats"]["bytes"] > 0
    check(got, samples, layout, seed=4)


def test_a_sample_larger_than_the_pool_is_refused_clearly() -> None:
    layout = CPU_LAYOUT
    samples = plan([5 * layout.block_size], seed=6, layout=layout)
    with HiddenStatesReader(pool_bytes=2 * layout.block_bytes) as reader:
        proc = ship(reader, layout, 6, samples)
        res = finish_sender(proc)
    assert res["rc"] == 1
    assert "larger" in res["failed"][samples[0]["request_id"]]


def test_a_producer_exiting_right_after_shipping_drains_everything_at_exit() -> None:
    """Samples shipped just before the process exits: the drain runs in an atexit hook,
    after Python stopped thread pools, and the last WRITEs' notifications race the
    closing control connection. Nothing may be lost."""
    layout = CPU_LAYOUT
    samples = plan([3 * layout.block_size] * 16, seed=9, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        proc = ship(reader, layout, 9, samples, exit_after_ship=True)
        res = finish_sender(proc)
        assert res["rc"] == 0 and res["unwritten_at_exit"] == 0 and not res["failed"], res["stderr"][-3000:]
        got = collect(reader, len(samples), timeout=10)
    check(got, samples, layout, seed=9)
