"""Samples on lease, with a real sender process and real NIXL: a sample handed out is a view
of the reader's pool; its pages stay its own until the lease ends (explicitly, with a
``with`` block, or when its last tensor is collected), while other samples flow through
the rest of the pool; a pool full of leases holds the producer back and loses nothing;
the copying mode hands out copies and returns pages at once."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from kv_connector.reader import HiddenStatesReader, LeaseLimitError, Sample, SampleReleased
from tests.integration.common import (
    CPU_LAYOUT,
    GPU_LAYOUT,
    NUM_CACHE_BLOCKS,
    Senders,
    check,
    expected_states,
    finish_sender,
    make_cache,
    plan,
    same_bytes,
)
from tests.integration.faulty_transport import watched_reader

pytestmark = pytest.mark.integration

LAYOUT = CPU_LAYOUT


def expected(s: dict[str, object], seed: int) -> torch.Tensor:
    cache = make_cache(LAYOUT, NUM_CACHE_BLOCKS, seed)
    return expected_states(cache, LAYOUT, s["block_ids"], s["num_tokens"])  # type: ignore[arg-type]


def pool_run(reader: HiddenStatesReader, pool: torch.Tensor, sample: Sample) -> range:
    """The pool pages the sample's states lie on."""
    hs, page = sample.hidden_states, reader.pool_state().page_bytes
    span = 1 + sum((n - 1) * st for n, st in zip(hs.shape, hs.stride(), strict=True))
    lo = hs.data_ptr() - pool.data_ptr()
    assert page > 0 and lo >= 0 and lo + span * hs.element_size() <= pool.numel(), "not in the pool"
    return range(lo // page, -(-(lo + span * hs.element_size()) // page))


@pytest.mark.parametrize("layout", [CPU_LAYOUT, GPU_LAYOUT], ids=["LTH-strided", "TLH-contiguous"])
def test_a_sample_is_a_view_of_the_pool_in_its_layout(layout: object, senders: Senders) -> None:
    samples = plan([40, 1, 33], seed=41, layout=layout)  # type: ignore[arg-type]
    reader, transport = watched_reader(pool_bytes=16 * layout.block_bytes)  # type: ignore[attr-defined]
    with reader:
        proc = senders.ship(reader, layout, 41, samples)  # type: ignore[arg-type]
        got = {}
        for _ in samples:
            s = reader.get(timeout=30)
            assert s.leased
            (pool,) = transport.registered
            hs = s.hidden_states
            lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel()
            assert lo <= hs.data_ptr() < hi, "not a view of the pool"
            # GPU layout: a plain [T, L, H] tensor; CPU layout: [L, T, H] in memory
            assert hs.is_contiguous() == (layout.layout == "TLH")  # type: ignore[attr-defined]
            got[s.request_id] = s
        check(got, samples, layout, seed=41)  # type: ignore[arg-type]
        for s in got.values():
            s.release()
            assert not s.leased
        assert finish_sender(proc)["rc"] == 0


def test_a_held_lease_blocks_exactly_its_pages_and_is_never_overwritten(senders: Senders) -> None:
    # room for two 4-block samples: one held all along, the others through the other half
    samples = plan([4 * LAYOUT.block_size] * 8, seed=42, layout=LAYOUT)
    reader, transport = watched_reader(pool_bytes=8 * LAYOUT.block_bytes)
    with reader:
        (pool,) = transport.registered
        proc = senders.ship(reader, LAYOUT, 42, samples)
        held = reader.get(timeout=30)
        held_pages = pool_run(reader, pool, held)
        want = expected(next(s for s in samples if s["request_id"] == held.request_id), 42)
        others = []
        for _ in samples[1:]:
            with reader.get(timeout=30) as s:  # released at the end of the block
                assert set(pool_run(reader, pool, s)).isdisjoint(held_pages)
                others.append(s.request_id)
                assert same_bytes(
                    s.hidden_states, expected(next(x for x in samples if x["request_id"] == s.request_id), 42)
                )
            # the held sample's bytes never changed while 7 others went through
            assert same_bytes(held.hidden_states, want)
        res = finish_sender(proc)
        assert res["rc"] == 0 and not res["failed"]
        deadline = time.monotonic() + 5
        while reader.pool_state().free != 4:  # the serving thread takes its credits back
            assert time.monotonic() < deadline, reader.pool_state()
            time.sleep(0.01)
        held.release()
        deadline = time.monotonic() + 5
        while reader.pool_state().free != 8:  # the serving thread takes the release
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert sorted([held.request_id, *others]) == sorted(s["request_id"] for s in samples)


def test_a_pool_full_of_leases_holds_the_producer_back_and_releasing_lets_it_go_on(senders: Senders) -> None:
    samples = plan([2 * LAYOUT.block_size] * 6, seed=43, layout=LAYOUT)
    with HiddenStatesReader(pool_bytes=4 * LAYOUT.block_bytes) as reader:
        proc = senders.ship(reader, LAYOUT, 43, samples)
        a, b = reader.get(timeout=30), reader.get(timeout=30)  # the whole pool, on lease
        with pytest.raises(TimeoutError):
            reader.get(timeout=1.5)  # the producer waits for credits: nothing lost, nothing more
        assert proc.poll() is None
        assert reader.pool_state().waiting >= 1
        got = {a.request_id: a, b.request_id: b}
        for s in (a, b):
            s.release()
        del a, b, s
        for _ in samples[2:]:
            s = reader.get(timeout=30)
            got[s.request_id] = s.hidden_states.clone()  # type: ignore[assignment]
            del s  # no reference left: its pages return when the tensor view is collected
        res = finish_sender(proc)
    assert res["rc"] == 0 and sorted(res["finished"]) == sorted(s["request_id"] for s in samples)
    assert set(got) == {s["request_id"] for s in samples}


def test_dropping_every_tensor_of_a_sample_ends_its_lease(senders: Senders) -> None:
    samples = plan([LAYOUT.block_size] * 3, seed=44, layout=LAYOUT)
    with HiddenStatesReader(pool_bytes=LAYOUT.block_bytes) as reader:  # one sample at a time
        proc = senders.ship(reader, LAYOUT, 44, samples)
        s = reader.get(timeout=30)
        first_layer = s.hidden_states[:, 0]  # a view of a view still holds the lease
        del s
        gc.collect()
        with pytest.raises(TimeoutError):
            reader.get(timeout=1.0)
        del first_layer  # the last view of the first sample: its page comes back
        for _ in samples[1:]:
            reader.get(timeout=30)  # each dropped at once by the next assignment
        assert finish_sender(proc)["rc"] == 0


def test_more_leases_than_allowed_is_a_clear_error_and_copies_are_not_leases(senders: Senders) -> None:
    samples = plan([5] * 4, seed=45, layout=LAYOUT)
    with HiddenStatesReader(pool_bytes=16 * LAYOUT.block_bytes, max_leases=2) as reader:
        proc = senders.ship(reader, LAYOUT, 45, samples)
        kept = [reader.get(timeout=30), reader.get(timeout=30)]
        with pytest.raises(LeaseLimitError, match=r"you hold 2 samples on lease .*release them"):
            reader.get(timeout=30)
        copies = [reader.get(timeout=30, copy=True) for _ in range(2)]
        assert all(not c.leased for c in copies) and all(k.leased for k in kept)
        got = {s.request_id: s for s in kept + copies}
        check(got, samples, LAYOUT, seed=45)
        assert finish_sender(proc)["rc"] == 0


def test_the_copying_mode_keeps_samples_beyond_the_pool_in_reused_buffers(senders: Senders) -> None:
    samples = plan([3 * LAYOUT.block_size] * 12, seed=46, layout=LAYOUT)
    with HiddenStatesReader(pool_bytes=3 * LAYOUT.block_bytes, copy=True) as reader:
        proc = senders.ship(reader, LAYOUT, 46, samples)
        got: dict[str, Sample] = {}
        for _ in range(6):  # six kept at once, in a pool that holds one: six buffers
            s = reader.get(timeout=30)
            assert not s.leased and s.hidden_states.is_contiguous()
            got[s.request_id] = s
        check(got, [x for x in samples if x["request_id"] in got], LAYOUT, 46)
        assert reader.copies_made == 6
        got.clear()
        del s
        gc.collect()
        for _ in range(6):  # the next six reuse them
            s = reader.get(timeout=30)
            got[s.request_id] = s
        check(got, [x for x in samples if x["request_id"] in got], LAYOUT, 46)
        assert reader.copies_made == 6
        assert finish_sender(proc)["rc"] == 0


def test_a_plain_for_loop_over_a_pool_of_one_sample_gets_every_sample(senders: Senders) -> None:
    """The loop variable holds the previous sample when the next is asked for: the
    iterator ends its lease then (it holds nothing else), or a pool of one sample would
    wait forever. What the loop keeps (a list of samples, a tensor, a view) stays leased
    and unchanged."""
    n = 4 * LAYOUT.block_size
    samples = plan([n] * 4, seed=47, layout=LAYOUT)
    with HiddenStatesReader(pool_bytes=8 * LAYOUT.block_bytes) as reader:  # two samples' room
        proc = senders.ship(reader, LAYOUT, 47, samples)
        kept: list[Sample] = []
        seen = []
        for i, s in enumerate(reader.samples(len(samples), timeout=30)):
            seen.append(s.request_id)
            assert s.leased
            if i == 0:
                kept.append(s.keep())  # kept: must stay leased and unchanged
                first_copy = s.hidden_states.clone()
            elif i == 1:
                second = s  # not kept: released when the loop asks for the next one
        assert len(seen) == len(samples)
        assert kept[0].leased and same_bytes(kept[0].hidden_states, first_copy)
        assert not second.leased
        with pytest.raises(SampleReleased, match="keep"):
            second.hidden_states  # noqa: B018  (its pages hold other data now)
        kept[0].release()
        assert finish_sender(proc)["rc"] == 0

    # one sample's room: only a loop that lets go of each sample gets through
    samples = plan([n] * 3, seed=48, layout=LAYOUT)
    with HiddenStatesReader(pool_bytes=4 * LAYOUT.block_bytes) as reader:
        proc = senders.ship(reader, LAYOUT, 48, samples)
        got = {}
        for s in reader.samples(len(samples), timeout=30):
            got[s.request_id] = s.hidden_states.clone()
        assert len(got) == len(samples)
        for spec in samples:
            assert same_bytes(got[spec["request_id"]], expected(spec, 48))  # type: ignore[index]
        assert finish_sender(proc)["rc"] == 0


@pytest.mark.parametrize("keep", ["keep()", "tensor", "view"])
def test_the_iterator_never_ends_a_lease_the_loop_still_uses(keep: str, senders: Senders) -> None:
    n = 4 * LAYOUT.block_size
    samples = plan([n] * 2, seed=49, layout=LAYOUT)
    with HiddenStatesReader(pool_bytes=8 * LAYOUT.block_bytes) as reader:
        proc = senders.ship(reader, LAYOUT, 49, samples)
        it = reader.samples(len(samples), timeout=30)
        s = next(it)
        held: object = {"keep()": s.keep(), "tensor": s.hidden_states, "view": s.hidden_states[1:3]}[keep]
        before = s.hidden_states.clone()
        nxt = next(it)
        assert s.leased and same_bytes(s.hidden_states, before)
        assert held is not None
        nxt.release()
        s.release()
        assert finish_sender(proc)["rc"] == 0
