"""Per-sample checksums with real sender processes and real NIXL: a share that lands
damaged in the reader's pool is written again and arrives exact; one that lands damaged
every time fails clearly, by name, on both sides; a WRITE that NIXL refuses is retried,
then fails clearly, and the reader drops the sample and keeps serving. The faults come
from a faulty transport in the sender (``tests/integration/faulty_transport.py``)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import pytest
import torch

from kv_connector.reader import HiddenStatesReader, Sample
from kv_connector.reader.pool import memory as pool_memory
from kv_connector.reader.push.ledger import MAX_REWRITES
from kv_connector.wire import protocol
from kv_connector.wire.layout import stripe
from tests.integration.common import (
    CPU_LAYOUT,
    GPU_LAYOUT,
    NUM_CACHE_BLOCKS,
    Senders,
    check,
    collect,
    expected_states,
    finish_sender,
    make_cache,
    plan,
    same_bytes,
)

pytestmark = pytest.mark.integration


def wait_for(cond: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def nothing_held(reader: HiddenStatesReader) -> bool:
    """No sample holds pages of the pool or waits for them (nothing on its way, nothing
    on lease): what the reader refused is gone from it."""
    ps = reader.pool_state()
    return ps.granted == 0 and ps.leased == 0 and ps.waiting == 0


@pytest.mark.parametrize("kind", ["xxh3", "blocks", "fingerprint"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_share_corrupted_in_the_pool_is_written_again_and_arrives_exact(
    world_size: int, kind: str, caplog: pytest.LogCaptureFixture, senders: Senders
) -> None:
    """The first WRITE of one rank's share of ``victim`` lands wrong bytes (a faulty
    transport at that rank); the reader's check catches it, that rank alone writes it
    again, and the sample arrives exact."""
    layout = GPU_LAYOUT if world_size == 2 else CPU_LAYOUT
    samples = plan([40, 3, 70], seed=11, layout=layout)
    victim = samples[0]["request_id"]
    blocks = -(-40 // layout.block_size)
    rank_hit = next(r for r in range(world_size) if blocks - 1 in stripe(blocks, r, world_size))
    caplog.set_level(logging.ERROR, logger="kv_connector")
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        procs = [
            senders.ship(
                reader,
                layout,
                11,
                samples,
                producer_id="p",
                rank=r,
                world_size=world_size,
                kind=kind,
                **(dict(garble=[victim], garble_times=1) if r == rank_hit else {}),
            )
            for r in range(world_size)
        ]
        got = collect(reader, len(samples), timeout=30)
        results = [finish_sender(p) for p in procs]
        assert reader.stats().checksum_mismatches == 1
    for res in results:
        assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    assert [r["garbled"] for r in results] == [[victim] if r == rank_hit else [] for r in range(world_size)]
    # only the rank whose share was hit wrote again
    assert [r["stats"]["rewrites"] for r in results] == [int(r == rank_hit) for r in range(world_size)]
    check(got, samples, layout, seed=11)
    assert any(victim in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)


def test_a_share_corrupt_at_its_source_fails_clearly_and_the_rest_arrive(
    caplog: pytest.LogCaptureFixture, senders: Senders
) -> None:
    layout = CPU_LAYOUT
    samples = plan([20, 33, 5], seed=12, layout=layout)
    victim = samples[1]["request_id"]
    caplog.set_level(logging.ERROR, logger="kv_connector")
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        # every WRITE of it lands wrong; the default record (fingerprints) catches it
        proc = senders.ship(reader, layout, 12, samples, garble=[victim], kind="fingerprint")
        # checksums are checked as samples are taken: keep taking until the sender is done
        got: dict[str, Sample] = {}
        end = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                s = reader.get(timeout=0.2, copy=True)
                assert s.request_id not in got and s.request_id != victim
                got[s.request_id] = s
        res = finish_sender(proc)
        with pytest.raises(TimeoutError):
            reader.get(timeout=0.5)  # the corrupt sample is never handed out
        assert reader.stats().checksum_mismatches == MAX_REWRITES + 1
        assert nothing_held(reader)
    assert sorted(res["finished"]) == sorted(s["request_id"] for s in samples if s["request_id"] != victim)
    assert list(res["failed"]) == [victim]
    assert "checksum" in res["failed"][victim] and victim in res["failed"][victim]
    assert res["stats"]["rewrites"] == MAX_REWRITES
    check(got, [s for s in samples if s["request_id"] != victim], layout, seed=12)
    assert any(victim in r.getMessage() and "refusing it" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("layout", [CPU_LAYOUT, GPU_LAYOUT], ids=["LTH", "TLH"])
def test_checksums_through_the_staging_path_match(layout: Any, senders: Senders) -> None:
    """The path a GPU cache takes (stage the share's blocks, then hash), run on CPU memory:
    the reader must find every share matching."""
    samples = plan([1, 16, 17, 45], seed=15, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        got, res = senders.deliver(reader, layout, 15, samples, stage_checksum=True)
        assert reader.stats().checksum_mismatches == 0
    assert res["rc"] == 0 and res["stats"]["checksum_s"] > 0
    check(got, samples, layout, seed=15)


def test_without_checksums_a_reader_that_requires_none_still_delivers(senders: Senders) -> None:
    layout = CPU_LAYOUT
    samples = plan([1, 17], seed=13, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes, require_checksum="never") as reader:
        got, res = senders.deliver(reader, layout, 13, samples, checksum=False)
    assert res["rc"] == 0 and res["stats"]["checksum_s"] == 0
    check(got, samples, layout, seed=13)


def test_by_default_a_host_cache_without_checksums_is_refused_clearly(senders: Senders) -> None:
    """The producer's cache is in host memory (hashing it costs little), so the reader
    requires its checksums: each request fails naming the option, nothing is handed out,
    and a producer with checksums is served next."""
    layout = CPU_LAYOUT
    samples = plan([1, 17], seed=15, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        proc = senders.ship(reader, layout, 15, samples, checksum=False, producer_id="unchecked")
        res = finish_sender(proc, timeout=60)
        with pytest.raises(TimeoutError):
            reader.get(timeout=1.0)
        assert res["rc"] == 1 and set(res["failed"]) == {s["request_id"] for s in samples}
        assert all("unchecked" in why and "require-checksum" in why for why in res["failed"].values())
        proc = senders.ship(reader, layout, 16, plan([9], seed=16, layout=layout), producer_id="checked")
        got = collect(reader, 1, timeout=30)
        assert finish_sender(proc)["rc"] == 0
    check(got, plan([9], seed=16, layout=layout), layout, seed=16)


def test_a_write_nixl_refuses_is_retried_then_fails_clearly_and_the_reader_keeps_serving(
    caplog: pytest.LogCaptureFixture, senders: Senders
) -> None:
    layout = CPU_LAYOUT
    samples = plan([20, 5], seed=14, layout=layout)
    caplog.set_level(logging.ERROR, logger="kv_connector")
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        # Fault injection: the broken producer's transport aims every WRITE at memory the
        # reader never registered, so NIXL itself refuses it (no descriptor covers it).
        proc = senders.ship(reader, layout, 14, samples, producer_id="broken", misaddress=True)
        res = finish_sender(proc, timeout=60)
        wait_for(lambda: nothing_held(reader), timeout=10)  # it told the reader to drop them
        # the reader keeps serving an honest producer
        good = senders.ship(reader, layout, 14, samples, producer_id="good")
        got = collect(reader, len(samples), timeout=30)
        good_res = finish_sender(good)
    assert sorted(res["failed"]) == sorted(s["request_id"] for s in samples)
    for why in res["failed"].values():
        assert "WRITE failed in NIXL 3 times" in why
    assert res["stats"]["write_retries"] == 2 * len(samples)
    assert res["elapsed_s"] < 10
    assert good_res["rc"] == 0
    check(got, samples, layout, seed=14)
    assert all(s.producer_id == "good" for s in got.values())
    assert any("gave up on" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("layout", [CPU_LAYOUT, GPU_LAYOUT], ids=["LTH", "TLH"])
def test_block_digests_computed_where_the_cache_is_match_at_the_reader(
    layout: Any, world_size: int, monkeypatch: pytest.MonkeyPatch, senders: Senders
) -> None:
    """The path a GPU cache takes by default (``checksum: auto`` -> block digests computed
    with torch where the cache is, the reader recomputing them from its pool on CPU), run
    on CPU memory: every share matches, the reader really checked, the bytes are exact."""
    samples = plan([1, 16, 17, 45], seed=16, layout=layout)
    checked: list[str] = []  # the reader recomputed block digests (the Hello said so), not bytes
    real = pool_memory.sample_block_digests

    def counting(states: torch.Tensor, m: protocol.Manifest, blocks: list[int]) -> list[int]:
        checked.append(m.request_id)
        return real(states, m, blocks)

    monkeypatch.setattr(pool_memory, "sample_block_digests", counting)
    monkeypatch.setattr(pool_memory, "sample_checksum", None)  # never called
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        procs = [
            senders.ship(reader, layout, 16, samples, producer_id="p", rank=r, world_size=world_size,
                 block_digests=True)
            for r in range(world_size)
        ]  # fmt: skip
        got = collect(reader, len(samples), timeout=30)
        results = [finish_sender(p) for p in procs]
        stats = reader.stats()
    assert stats.checksum_mismatches == 0 and stats.verify_s > 0
    shares = [
        s["request_id"]
        for s in samples
        for r in range(world_size)
        if stripe(-(-s["num_tokens"] // layout.block_size), r, world_size)  # an empty share has no check
    ]
    assert sorted(checked) == sorted(shares)
    for res in results:
        assert res["rc"] == 0 and res["stats"]["checksum_s"] > 0, res["stderr"][-3000:]
    check(got, samples, layout, seed=16)


def test_a_write_in_flight_when_the_reader_gives_up_never_lands_on_another_sample(senders: Senders) -> None:
    """The reader refuses sample A at its deadline while A's WRITE is in flight (posted at
    the producer, stuck 10 s, longer than any quarantine, then landing). A's pages go to
    nobody until the producer fences that grant (its WRITE ended); B, which needs those
    very pages, is granted only then, and stays exact on lease after A's WRITE landed.
    (Before the fences, B got the pages 5 s after A's refusal and A's WRITE landed over
    it, a sample already handed out.)"""
    layout, seed, late_s = CPU_LAYOUT, 31, 10.0
    a, b = plan([3 * layout.block_size, 3 * layout.block_size], seed=seed, layout=layout)
    pool = 3 * layout.block_bytes  # one sample's pages: B needs A's
    with HiddenStatesReader(pool_bytes=pool, page_bytes=layout.block_bytes, sample_timeout_s=1.0) as reader:
        t0 = time.monotonic()
        proc = senders.ship(reader, layout, seed, [a, b], delay={a["request_id"]: late_s})
        got = reader.get(timeout=60, copy=False)  # on lease: a view of the pool's pages
        assert got.request_id == b["request_id"] and got.leased
        result = finish_sender(proc)
        time.sleep(max(0.0, t0 + late_s + 3.0 - time.monotonic()))  # A's WRITE has landed by now
        cache = make_cache(layout, NUM_CACHE_BLOCKS, seed)
        want = expected_states(cache, layout, b["block_ids"], b["num_tokens"])
        assert same_bytes(got.hidden_states, want), "a late WRITE landed on a sample on lease"
        got.release()
        assert result["finished"] == [b["request_id"]], result
        assert "refused (timeout)" in result["failed"][a["request_id"]], result
        assert reader.stats().refused == 1
        with pytest.raises(TimeoutError):
            reader.get(timeout=0.5)  # A is never handed out
        wait_for(lambda: reader.pool_state().free == reader.pool_state().num_pages)
