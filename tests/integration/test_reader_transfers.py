"""Real NIXL WRITEs from sender processes into the reader: byte-exact samples, scattered
blocks, credits that throttle, pieces smaller than blocks, and ranks that share samples."""

from __future__ import annotations

import random

import msgspec
import pytest

from kv_connector.reader import HiddenStatesReader
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.provenance import Expectation, ModelRunner, Provenance
from tests.integration.common import CPU_LAYOUT, GPU_LAYOUT, Senders, check, collect, finish_sender, plan

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("layout", [CPU_LAYOUT, GPU_LAYOUT], ids=["cpu-LTH-fp32", "gpu-TLH-bf16"])
def test_samples_of_every_boundary_size_arrive_byte_exact(layout: BlockLayout, senders: Senders) -> None:
    bs = layout.block_size
    samples = plan([1, bs, bs + 1, 7 * bs + 5, 2 * bs - 1], seed=1, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        got, res = senders.deliver(reader, layout, 1, samples)
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
    layout: BlockLayout, pad_bytes: int, digests: bool, senders: Senders
) -> None:
    """vLLM pads the hidden-state group's page to the other groups' when a model mixes
    kinds of layer and the design cannot lend it a block table: blocks lie a page apart,
    more than one block; the samples carry their data, byte-exact, checked end to end."""
    bs = layout.block_size
    samples = plan([1, bs, bs + 1, 7 * bs + 5, 2 * bs - 1, 40], seed=3, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        # XXH3 through the staging path a GPU cache takes, or block digests
        got, res = senders.deliver(
            reader, layout, 3, samples, pad_bytes=pad_bytes, block_digests=digests, stage_checksum=not digests
        )
    assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    check(got, samples, layout, seed=3, pad_bytes=pad_bytes)


def test_more_samples_than_the_pool_holds_are_throttled_not_lost(senders: Senders) -> None:
    layout = CPU_LAYOUT
    rng = random.Random(5)
    samples = plan([rng.randint(1, 4 * layout.block_size) for _ in range(40)], seed=2, layout=layout)
    # Four blocks of room: at most a sample or two in flight at a time.
    with HiddenStatesReader(pool_bytes=4 * layout.block_bytes) as reader:
        got, res = senders.deliver(reader, layout, 2, samples)
        assert reader.stats().samples == len(samples)
    assert res["rc"] == 0 and sorted(res["finished"]) == sorted(s["request_id"] for s in samples)
    check(got, samples, layout, seed=2)


@pytest.mark.parametrize("ahead", [2, 0], ids=["credits-ahead", "no-credits"])
def test_samples_of_a_producer_of_one_rank_go_into_credits_ahead_without_a_round_trip(
    ahead: int, senders: Senders
) -> None:
    """A producer of one rank places most samples in runs of pages granted ahead (no
    credit request, no grant); its first, and any larger than its credits, ask. Byte-exact
    either way, and with no credits asked for, none is granted."""
    layout = CPU_LAYOUT
    rng = random.Random(8)
    sizes = [3 * layout.block_size] + [rng.randint(1, 3 * layout.block_size) for _ in range(29)]
    samples = plan(sizes, seed=8, layout=layout)
    with HiddenStatesReader(pool_bytes=16 * layout.block_bytes) as reader:
        got, res = senders.deliver(reader, layout, 8, samples, credits_ahead=ahead, in_flight=3)
        assert reader.stats().samples == len(samples)
    assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    check(got, samples, layout, seed=8)
    placed, credits = res["stats"]["placed"], res["stats"]["credits"]
    if ahead:
        assert placed >= len(samples) // 2 and credits >= placed, res["stats"]
    else:
        assert placed == credits == 0


def test_two_producers_share_a_small_pool_through_recalled_credits(senders: Senders) -> None:
    """Credits ahead are recalled whenever another producer's sample waits for pages, and
    given back when a sample fits none: two producers of one rank, samples of many sizes, a
    pool of two of the largest; every sample arrives byte-exact and none fails."""
    layout = CPU_LAYOUT
    rng = random.Random(9)
    a = plan([rng.randint(1, 3 * layout.block_size) for _ in range(20)], seed=9, layout=layout)
    b = plan([rng.randint(1, 3 * layout.block_size) for _ in range(20)], seed=10, layout=layout)
    for s in b:
        s["request_id"] = "b-" + s["request_id"]
    with HiddenStatesReader(pool_bytes=6 * layout.block_bytes) as reader:
        pa = senders.ship(reader, layout, 9, a, producer_id="pa", in_flight=3)
        pb = senders.ship(reader, layout, 10, b, producer_id="pb", in_flight=3)
        got = collect(reader, len(a) + len(b))
        results = [finish_sender(p) for p in (pa, pb)]
    for res in results:
        assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    check({k: v for k, v in got.items() if not k.startswith("b-")}, a, layout, seed=9)
    check({k: v for k, v in got.items() if k.startswith("b-")}, b, layout, seed=10)
    # credits were granted between the two producers' waits, and recalled or placed
    assert sum(r["stats"]["credits"] for r in results) > 0


def test_blocks_larger_than_pages_travel_in_pieces(senders: Senders) -> None:
    layout = CPU_LAYOUT
    samples = plan([1, 33, 100], seed=3, layout=layout)
    page = layout.block_bytes // 3 + 100  # three pieces per block, the last one short
    with HiddenStatesReader(pool_bytes=40 * page, page_bytes=page) as reader:
        got, res = senders.deliver(reader, layout, 3, samples)
    assert res["rc"] == 0, res["stderr"][-3000:]
    check(got, samples, layout, seed=3)


def test_two_ranks_each_write_their_share_of_every_sample(senders: Senders) -> None:
    layout = GPU_LAYOUT
    samples = plan([1, 16, 17, 80, 47], seed=4, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        procs = [
            senders.ship(reader, layout, 4, samples, producer_id="tp", rank=r, world_size=2) for r in range(2)
        ]
        got = collect(reader, len(samples))
        results = [finish_sender(p) for p in procs]
    for res in results:
        assert res["rc"] == 0, res["stderr"][-3000:]
    # Rank 0 writes ceil(n/2) blocks, rank 1 the rest: both links carry bytes.
    assert results[0]["stats"]["bytes"] > 0 and results[1]["stats"]["bytes"] > 0
    check(got, samples, layout, seed=4)


def test_a_sample_larger_than_the_pool_is_refused_clearly(senders: Senders) -> None:
    layout = CPU_LAYOUT
    samples = plan([5 * layout.block_size], seed=6, layout=layout)
    with HiddenStatesReader(pool_bytes=2 * layout.block_bytes) as reader:
        proc = senders.ship(reader, layout, 6, samples)
        res = finish_sender(proc)
    assert res["rc"] == 1
    assert "larger" in res["failed"][samples[0]["request_id"]]


def test_a_sample_other_than_expected_is_refused_by_name_and_one_as_expected_says_what_it_is(
    senders: Senders,
) -> None:
    layout = CPU_LAYOUT
    made = {"vllm_version": "0.33.0", "model_runner": "v2", "model": "/models/Qwen/Qwen3-8B"}
    samples = plan([layout.block_size + 3], seed=8, layout=layout)
    expect = Expectation(layer_ids=list(range(layout.num_layers)), model="meta-llama/Llama-3.1-8B")
    with HiddenStatesReader(expect=expect) as reader:
        res = finish_sender(senders.ship(reader, layout, 8, samples, provenance=made))
        stats = reader.stats()
        assert stats.refused_mismatch == 1 and stats.samples == 0
    assert res["rc"] == 1
    why = res["failed"][samples[0]["request_id"]]
    assert "mismatch" in why and "model /models/Qwen/Qwen3-8B, expected meta-llama/Llama-3.1-8B" in why
    with HiddenStatesReader(expect=msgspec.structs.replace(expect, model="Qwen/Qwen3-8B")) as reader:
        proc = senders.ship(reader, layout, 8, samples, provenance=made)
        got = collect(reader, 1)
        res = finish_sender(proc)
    assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    (sample,) = got.values()
    want = Provenance(vllm_version="0.33.0", model_runner=ModelRunner.V2, model=made["model"])
    assert sample.provenance == want
    check(got, samples, layout, seed=8)


def test_a_producer_exiting_right_after_shipping_drains_everything_at_exit(senders: Senders) -> None:
    """Samples shipped just before the process exits: the drain runs in an atexit hook,
    after Python stopped thread pools, and the last WRITEs' notifications race the
    closing control connection. Nothing may be lost."""
    layout = CPU_LAYOUT
    samples = plan([3 * layout.block_size] * 16, seed=9, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        proc = senders.ship(reader, layout, 9, samples, exit_after_ship=True)
        res = finish_sender(proc)
        assert res["rc"] == 0 and res["unwritten_at_exit"] == 0 and not res["failed"], res["stderr"][-3000:]
        got = collect(reader, len(samples), timeout=10)
    check(got, samples, layout, seed=9)
