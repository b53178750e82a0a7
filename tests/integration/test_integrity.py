"""Per-sample checksums with real sender processes and real NIXL: a share corrupted in
the reader's pool after it landed, before its check, is written again and arrives
exact; a share whose source is corrupt fails clearly, by name, on both sides; a WRITE
that NIXL refuses is retried, then fails clearly, and the reader drops the sample and
keeps serving."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import pytest
import torch

from kv_connector.reader import HiddenStatesReader, Sample, checker
from kv_connector.reader.ledger import MAX_REWRITES
from kv_connector.wire import protocol
from kv_connector.wire.layout import stripe
from kv_connector.wire.transport import Region
from tests.integration.common import finish_sender
from tests.integration.test_reader_transfers import CPU_LAYOUT, GPU_LAYOUT, check, collect, plan, ship

pytestmark = pytest.mark.integration


def wait_for(cond: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def corrupt_before_the_check(
    monkeypatch: pytest.MonkeyPatch, reader: HiddenStatesReader, victim: str
) -> list[int]:
    """Fault injection: the first time the reader's checking thread checks a share of
    ``victim``, flip the first byte of that share's last block in the pool first (as it
    landed, before its check), whichever checksum it has. Returns the blocks hit."""
    real, real_blocks = checker.sample_checksum, checker.sample_block_digests
    hit: list[int] = []

    def flip(m: protocol.Manifest, base: int, blocks: list[int]) -> None:
        if m.request_id == victim and not hit:
            (dst, _), *_ = m.geometry.arranged(m.num_blocks, blocks[-1], 0, 1)
            reader._pool_tensor[base + dst] ^= 0xFF
            hit.append(blocks[-1])

    def corrupting(pool: memoryview, base: int, m: protocol.Manifest, blocks: list[int]) -> int:
        flip(m, base, blocks)
        return real(pool, base, m, blocks)

    def corrupting_blocks(states: torch.Tensor, m: protocol.Manifest, blocks: list[int]) -> list[int]:
        base = states.untyped_storage().data_ptr() - reader._pool_tensor.data_ptr()
        flip(m, base, blocks)
        return real_blocks(states, m, blocks)

    monkeypatch.setattr(checker, "sample_checksum", corrupting)
    monkeypatch.setattr(checker, "sample_block_digests", corrupting_blocks)
    return hit


@pytest.mark.parametrize("block_digests", [False, True], ids=["xxh3", "blocks"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_share_corrupted_in_the_pool_is_written_again_and_arrives_exact(
    world_size: int, block_digests: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = GPU_LAYOUT if world_size == 2 else CPU_LAYOUT
    samples = plan([40, 3, 70], seed=11, layout=layout)
    victim = samples[0]["request_id"]
    caplog.set_level(logging.ERROR, logger="kv_connector")
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        hit = corrupt_before_the_check(monkeypatch, reader, victim)
        procs = [
            ship(
                reader,
                layout,
                11,
                samples,
                producer_id="p",
                rank=r,
                world_size=world_size,
                block_digests=block_digests,
            )
            for r in range(world_size)
        ]
        got = collect(reader, len(samples), timeout=30)
        results = [finish_sender(p) for p in procs]
        assert reader.stats().checksum_mismatches == 1 and len(hit) == 1
    for res in results:
        assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    # only the rank whose share was hit wrote again
    blocks = -(-40 // layout.block_size)
    rank_hit = next(r for r in range(world_size) if hit[0] in stripe(blocks, r, world_size))
    assert [r["stats"]["rewrites"] for r in results] == [int(r == rank_hit) for r in range(world_size)]
    check(got, samples, layout, seed=11)
    assert any(victim in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)


def test_a_share_corrupt_at_its_source_fails_clearly_and_the_rest_arrive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = CPU_LAYOUT
    samples = plan([20, 33, 5], seed=12, layout=layout)
    victim = samples[1]["request_id"]
    caplog.set_level(logging.ERROR, logger="kv_connector")
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        proc = ship(reader, layout, 12, samples, corrupt_after_checksum=[victim])
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
        assert not reader._ledger.samples
    assert sorted(res["finished"]) == sorted(s["request_id"] for s in samples if s["request_id"] != victim)
    assert list(res["failed"]) == [victim]
    assert "checksum" in res["failed"][victim] and victim in res["failed"][victim]
    assert res["stats"]["rewrites"] == MAX_REWRITES
    check(got, [s for s in samples if s["request_id"] != victim], layout, seed=12)
    assert any(victim in r.getMessage() and "refusing it" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("layout", [CPU_LAYOUT, GPU_LAYOUT], ids=["LTH", "TLH"])
def test_checksums_through_the_staging_path_match(layout: Any) -> None:
    """The path a GPU cache takes (stage the share's blocks, then hash), run on CPU memory:
    the reader must find every share matching."""
    samples = plan([1, 16, 17, 45], seed=15, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        proc = ship(reader, layout, 15, samples, stage_checksum=True)
        got = collect(reader, len(samples), timeout=30)
        res = finish_sender(proc)
        assert reader.stats().checksum_mismatches == 0
    assert res["rc"] == 0 and res["stats"]["checksum_s"] > 0
    check(got, samples, layout, seed=15)


def test_without_checksums_a_reader_that_requires_none_still_delivers() -> None:
    layout = CPU_LAYOUT
    samples = plan([1, 17], seed=13, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes, require_checksum="never") as reader:
        proc = ship(reader, layout, 13, samples, checksum=False)
        got = collect(reader, len(samples), timeout=30)
        res = finish_sender(proc)
    assert res["rc"] == 0 and res["stats"]["checksum_s"] == 0
    check(got, samples, layout, seed=13)


def test_by_default_a_host_cache_without_checksums_is_refused_clearly() -> None:
    """The producer's cache is in host memory (hashing it costs little), so the reader
    requires its checksums: each request fails naming the option, nothing is handed out,
    and a producer with checksums is served next."""
    layout = CPU_LAYOUT
    samples = plan([1, 17], seed=15, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        proc = ship(reader, layout, 15, samples, checksum=False, producer_id="unchecked")
        res = finish_sender(proc, timeout=60)
        with pytest.raises(TimeoutError):
            reader.get(timeout=1.0)
        assert res["rc"] == 1 and set(res["failed"]) == {s["request_id"] for s in samples}
        assert all("unchecked" in why and "require-checksum" in why for why in res["failed"].values())
        proc = ship(reader, layout, 16, plan([9], seed=16, layout=layout), producer_id="checked")
        got = collect(reader, 1, timeout=30)
        assert finish_sender(proc)["rc"] == 0
    check(got, plan([9], seed=16, layout=layout), layout, seed=16)


def test_a_write_nixl_refuses_is_retried_then_fails_clearly_and_the_reader_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = CPU_LAYOUT
    samples = plan([20, 5], seed=14, layout=layout)
    caplog.set_level(logging.ERROR, logger="kv_connector")
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        real = reader._server._region
        # Fault injection: the Welcome points at memory the reader never registered, so
        # NIXL itself refuses every WRITE (no descriptor of the remote agent covers it).
        reader._server._region = Region(real.addr + (1 << 40), real.nbytes, real.mem_type, real.device_id)
        proc = ship(reader, layout, 14, samples, producer_id="broken")
        res = finish_sender(proc, timeout=60)
        wait_for(lambda: not reader._ledger.samples, timeout=10)  # it told the reader to drop them
        reader._server._region = real
        # the reader keeps serving an honest producer
        good = ship(reader, layout, 14, samples, producer_id="good")
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
    layout: Any, world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path a GPU cache takes by default (``checksum: auto`` -> block digests computed
    with torch where the cache is, the reader recomputing them from its pool on CPU), run
    on CPU memory: every share matches, the reader really checked, the bytes are exact."""
    samples = plan([1, 16, 17, 45], seed=16, layout=layout)
    checked: list[str] = []  # the reader recomputed block digests (the Hello said so), not bytes
    real = checker.sample_block_digests

    def counting(states: torch.Tensor, m: protocol.Manifest, blocks: list[int]) -> list[int]:
        checked.append(m.request_id)
        return real(states, m, blocks)

    monkeypatch.setattr(checker, "sample_block_digests", counting)
    monkeypatch.setattr(checker, "sample_checksum", None)  # never called
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes) as reader:
        procs = [
            ship(reader, layout, 16, samples, producer_id="p", rank=r, world_size=world_size,
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
