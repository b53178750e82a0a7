"""The device-pool path (``pool_device``) with real NIXL between processes, run on host
memory (``pool_device="cpu"``: the same code a GPU pool runs, registered as DRAM here):
push WRITEs and pull READs land in the pool byte for byte, both checksum kinds are
recomputed from the pool with torch, bad states and garbled blocks are refused by name,
samples are views of the pool whose pages return when released, collected or copied."""

from __future__ import annotations

import gc
import time

import pytest

from kv_connector.reader import FetchError, HiddenStatesReader, PullClient, Sample
from kv_connector.wire.layout import BlockLayout
from tests.integration.common import (
    CPU_LAYOUT,
    GPU_LAYOUT,
    Senders,
    expected_states,
    finish_sender,
    make_cache,
    plan,
    same_bytes,
    token_ids,
)
from tests.integration.pull_common import LAYER_IDS, NUM_CACHE_BLOCKS, SEED, Producer, samples_spec, spec_of

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("layout", "digests"), [(CPU_LAYOUT, False), (GPU_LAYOUT, True)], ids=["LTH-xxh3", "TLH-blocks"]
)
def test_push_lands_in_a_device_pool_byte_exact_as_views_whose_pages_return(
    layout: BlockLayout, digests: bool, senders: Senders
) -> None:
    """Every sample is a view of the pool; kept ones stay on lease, released and dropped
    ones give their pages back; once all are let go, every page is free."""
    bs = layout.block_size
    samples = plan([1, bs, bs + 1, 5 * bs + 3, 2 * bs - 1, 40], seed=6, layout=layout)
    pool_bytes = 64 * layout.block_bytes
    with HiddenStatesReader(pool_bytes=pool_bytes, pool_device="cpu", check_values=True) as reader:
        proc = senders.ship(reader, layout, 6, samples, block_digests=digests, finite=True)
        got: dict[str, Sample] = {}
        pointers = []
        for i in range(len(samples)):
            s = reader.get(timeout=60)
            assert s.leased
            pointers.append(s.hidden_states.data_ptr())
            if i % 3 == 0:  # kept on lease
                got[s.request_id] = s.keep()
                continue
            copy = Sample(s.request_id, s.token_ids, s.hidden_states.clone(), s.layer_ids)
            got[s.request_id] = copy
            if i % 3 == 1:
                s.release()
            else:
                del s
                gc.collect()  # dropped: its lease ends when collected
        res = finish_sender(proc)
        assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
        cache = make_cache(layout, NUM_CACHE_BLOCKS_PUSH, 6, finite=True)
        assert sorted(got) == sorted(x["request_id"] for x in samples)
        for spec in samples:
            s = got[spec["request_id"]]
            assert s.token_ids.tolist() == token_ids(spec["request_id"], spec["num_tokens"])
            want = expected_states(cache, layout, spec["block_ids"], spec["num_tokens"])
            assert same_bytes(s.hidden_states, want), spec["request_id"]
        assert reader.pool_state().leased > 0  # the kept ones
        for s in got.values():
            s.release()
        deadline = time.monotonic() + 10
        while reader.pool_state().leased and time.monotonic() < deadline:
            time.sleep(0.01)  # the serving thread takes the releases
        state = reader.pool_state()
        assert state.leased == 0 and state.granted == 0, state  # every page back
        assert reader.stats().samples == len(samples) and reader.stats().checksum_mismatches == 0
    # views of one pool of pool_bytes, not copies elsewhere
    assert max(pointers) - min(pointers) < pool_bytes


def test_push_into_a_device_pool_refuses_bad_states_by_name(senders: Senders) -> None:
    layout = GPU_LAYOUT
    samples = plan([20, 33, 17], seed=8, layout=layout)
    samples[1]["poison"] = "nan"
    with HiddenStatesReader(
        pool_bytes=64 * layout.block_bytes, pool_device="cpu", check_values=True
    ) as reader:
        proc = senders.ship(reader, layout, 8, samples, block_digests=True, finite=True)
        got = [reader.get(timeout=60, copy=True) for _ in range(2)]
        with pytest.raises(TimeoutError):  # the values check runs in get(): one more looks at the last
            reader.get(timeout=2.0)
        res = finish_sender(proc)
    assert sorted(s.request_id for s in got) == sorted([samples[0]["request_id"], samples[2]["request_id"]])
    assert list(res["failed"]) == [samples[1]["request_id"]]
    assert "NaN/Inf" in next(iter(res["failed"].values()))
    cache = make_cache(layout, NUM_CACHE_BLOCKS_PUSH, 8, finite=True)
    for s in got:
        spec = next(x for x in samples if x["request_id"] == s.request_id)
        assert same_bytes(
            s.hidden_states, expected_states(cache, layout, spec["block_ids"], spec["num_tokens"])
        )


NUM_CACHE_BLOCKS_PUSH = 64  # tests.integration.common's cache for sender processes


@pytest.mark.parametrize("checksum", ["xxh3", "blocks"])
@pytest.mark.parametrize(
    "layout",
    [BlockLayout("LTH", 16, 3, 32, "float32"), BlockLayout("TLH", 16, 3, 32, "bfloat16")],
    ids=["LTH", "TLH"],
)
def test_pull_reads_into_a_device_pool_byte_exact(
    layout: BlockLayout, checksum: str, producers: list[Producer]
) -> None:
    samples = samples_spec(6, layout, seed=9)
    p = Producer(spec_of(layout, samples, world_size=2, checksum=checksum))
    producers.append(p)
    cache = make_cache(layout, NUM_CACHE_BLOCKS, SEED, finite=True)
    with PullClient(pool_bytes=4 << 20, pool_device="cpu") as client:
        one = client.fetch(p.handles[samples[0]["request_id"]])
        copied = PullClient(pool_bytes=4 << 20, pool_device="cpu", copy=True)
        got = [one, *client.fetch_many([p.handles[s["request_id"]] for s in samples[1:4]])]
        got += [copied.fetch(p.handles[s["request_id"]]) for s in samples[4:]]
        for s, sample in zip(samples, got, strict=True):
            assert not isinstance(sample, FetchError), sample
            assert sample.token_ids.tolist() == token_ids(s["request_id"], s["num_tokens"])
            want = expected_states(cache, layout, s["block_ids"], s["num_tokens"])
            assert same_bytes(sample.hidden_states, want) and sample.layer_ids == tuple(LAYER_IDS)
        assert [s.leased for s in got] == [True] * 4 + [False] * 2  # views on lease, then copies
        for sample in got:
            sample.release()
        copied.close()
    polled = p.settled([0, 0])
    assert polled["held"] == [0, 0]


def test_pull_into_a_device_pool_finds_a_garbled_block(producers: list[Producer]) -> None:
    layout = BlockLayout("TLH", 16, 3, 32, "bfloat16")
    samples = samples_spec(2, layout, seed=10)
    p = Producer(spec_of(layout, samples, checksum="blocks"))
    producers.append(p)
    with PullClient(pool_bytes=4 << 20, pool_device="cpu") as client:
        first = client.fetch(p.handles["req-0"], release=False)  # the checksum is taken, kept
        first.release()
        p.garble("req-0")
        with pytest.raises(FetchError) as e:
            client.fetch(p.handles["req-0"])
        assert e.value.code == "checksum" and "sample req-0" in e.value.message
        ok = client.fetch(p.handles["req-1"])  # the client goes on serving others
        assert ok.request_id == "req-1"
        ok.release()
