"""The pull server's checksums, without NIXL or a consumer: a stand-in transport, the
server's answer to a ``PullFetch`` built directly. Its checksum is the kind the
connector's ``checksum`` option resolves to (as push's), the share says which, and the
consumer's recomputation from the bytes it would READ matches; block digests are taken
from the cache where it is, never staged."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
import torch

from kv_connector.cache import blocks as cache_blocks
from kv_connector.cache.blocks import CacheBlocks
from kv_connector.producer.fingerprints import Fingerprints
from kv_connector.producer.options import ChecksumOption
from kv_connector.producer.pull import server as pull_server
from kv_connector.producer.pull.server import PullServer, PullServerConfig
from kv_connector.reader.pool.memory import pool_checksum
from kv_connector.wire import protocol
from kv_connector.wire.handle import make_nonce
from kv_connector.wire.layout import BlockLayout, stripe
from kv_connector.wire.protocol import ShareChecksum
from kv_connector.wire.transport import Region, Transport

NUM_BLOCKS = 12
LTH = BlockLayout("LTH", 16, 3, 8, "float32")
TLH = BlockLayout("TLH", 16, 3, 8, "bfloat16")


class StandIn:
    """Registers memory by its address; moves nothing."""

    name = "stand-in"
    metadata = b"meta"

    def register(self, tensor: torch.Tensor) -> Region:
        return Region(tensor.data_ptr(), tensor.numel() * tensor.element_size(), "DRAM", 0)

    def notifications(self) -> list[tuple[str, bytes]]:
        return []

    def close(self) -> None:
        pass


def server(cache: torch.Tensor, layout: BlockLayout, checksum: ShareChecksum | None, **kw: Any) -> PullServer:
    config = PullServerConfig(
        layout,
        (1, 2, 3),
        "p",
        ("127.0.0.1", 0),
        60.0,
        kw.pop("rank", 0),
        kw.pop("world", 1),
        checksum,
        secret=b"",
    )
    return PullServer(cache, config, transport=cast(Transport, StandIn()), **kw)


def cache_of(layout: BlockLayout) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(NUM_BLOCKS, *layout.block_shape(), generator=g).to(getattr(torch, layout.dtype))


def read(cache: torch.Tensor, share: protocol.PullShare) -> memoryview:
    """The pool run a consumer READs this share into (as ``PullClient._post_read``)."""
    m = share.manifest
    g = m.geometry
    src = cache.view(-1).view(torch.uint8).numpy()
    pool = np.zeros(g.sample_bytes(m.num_blocks), dtype=np.uint8)
    for i, block in enumerate(share.block_ids):
        for s, d, n in g.arranged_spans(m.num_blocks, share.first_block + i):
            pool[d : d + n] = src[block * share.pitch + s : block * share.pitch + s + n]
    return pool.data


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("layout", [LTH, TLH], ids=["LTH", "TLH"])
@pytest.mark.parametrize("option", list(ChecksumOption), ids=lambda o: o.value)
def test_a_share_carries_the_checksum_its_option_resolves_to_and_the_consumer_agrees(
    option: ChecksumOption, layout: BlockLayout, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = option.resolve(False, layout)  # a host cache: "auto" is XXH3 here
    fp = ShareChecksum.FINGERPRINT
    kinds = {"auto": fp, "fingerprint": fp, "xxh3": ShareChecksum.XXH3, "blocks": ShareChecksum.BLOCKS}
    assert kind is kinds.get(option.value)
    if kind in (ShareChecksum.BLOCKS, fp):  # nothing is staged to host memory (nor hashed as bytes)
        monkeypatch.setattr(cache_blocks, "share_checksum", None)
    cache = cache_of(layout)
    nonce, tokens, blocks = make_nonce(), list(range(3 * layout.block_size + 5)), [9, 2, 7, 4]
    for rank in range(world):
        s = server(cache, layout, kind, rank=rank, world=world)
        try:
            assert s.checksum_kind is (kind or ShareChecksum.XXH3)  # what its Hello says
            # the words the steps took (FINGERPRINT's record), as the worker side hands them over
            taken = Fingerprints(CacheBlocks(cache, layout), layout.block_size)
            words = taken.ship("req-1", len(tokens), blocks)
            s.hold("req-1", nonce, tokens, blocks, words=words)
            share = s.answer(protocol.PullFetch(request_id="req-1", nonce=nonce))
            again = s.answer(protocol.PullFetch(request_id="req-1", nonce=nonce))  # taken once, kept
        finally:
            s.close()
        assert isinstance(share, protocol.PullShare) and share == again
        assert share.checksum_kind is (kind or ShareChecksum.XXH3)
        assert protocol.decode(protocol.encode(share)) == share
        mine = list(stripe(4, rank, world))
        assert share.block_ids == [blocks[j] for j in mine]
        if kind is None:
            assert share.checksum is None
            continue
        pool = read(cache, share)
        assert share.checksum == pool_checksum(pool, 0, share.manifest, mine, share.checksum_kind)
        other = ShareChecksum.XXH3 if kind is not ShareChecksum.XXH3 else ShareChecksum.BLOCKS
        assert share.checksum != pool_checksum(pool, 0, share.manifest, mine, other)
        _, first, _ = layout.arranged_spans(4, mine[0])[0]  # where the share's first block lands
        np.frombuffer(pool, dtype=np.uint8)[first + 3] ^= 1  # one bit of it
        assert share.checksum != pool_checksum(pool, 0, share.manifest, mine, share.checksum_kind)


def test_block_digests_of_rows_that_are_not_whole_words_are_refused() -> None:
    odd = BlockLayout("LTH", 16, 3, 3, "bfloat16")  # a row of 6 bytes
    with pytest.raises(ValueError, match="whole 8-byte words"):
        server(cache_of(odd), odd, ShareChecksum.BLOCKS)
    with pytest.raises(ValueError, match="whole 8-byte words"):
        ChecksumOption.BLOCKS.resolve(False, odd)


def test_a_finished_sample_is_hashed_in_the_background_once_and_a_fetch_waits_for_that(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a host cache the share's XXH3 is taken on the server's own thread once the
    request finished (while its response travels), not by the fetch: a fetch that comes
    while it runs waits for it, and nothing is hashed twice."""
    import threading

    calls: list[str] = []
    gate = threading.Event()
    real = cache_blocks.share_checksum

    def hashing(raw: torch.Tensor, job: Any, *how: Any) -> int:
        calls.append(threading.current_thread().name)
        assert gate.wait(10)
        return real(raw, job, *how)

    monkeypatch.setattr(cache_blocks, "share_checksum", hashing)
    cache = cache_of(TLH)
    s = server(cache, TLH, ShareChecksum.XXH3)
    try:
        nonces = {rid: make_nonce() for rid in ("a", "b")}
        for i, (rid, nonce) in enumerate(nonces.items()):
            s.hold(rid, nonce, list(range(2 * TLH.block_size)), [3 + 2 * i, 4 + 2 * i])
        s.finished(["a"])  # "b" has not finished: its handle is not out, nothing is taken yet
        answers: list[Any] = []
        ask_a = protocol.PullFetch("a", nonces["a"])
        fetch = threading.Thread(target=lambda: answers.append(s.answer(ask_a)))
        fetch.start()
        fetch.join(0.2)
        assert fetch.is_alive() and calls == ["hs-pull-r0-hash"]  # the fetch waits for the hash
        gate.set()
        fetch.join(10)
        share = answers[0]
        assert isinstance(share, protocol.PullShare)
        kind = share.checksum_kind
        assert share.checksum == pool_checksum(read(cache, share), 0, share.manifest, [0, 1], kind)
        assert s.answer(protocol.PullFetch("a", nonces["a"])) == share
        assert calls == ["hs-pull-r0-hash"]  # taken once
        late = s.answer(protocol.PullFetch("b", nonces["b"]))  # fetched before its finish: taken here
        assert isinstance(late, protocol.PullShare) and late.checksum is not None
        assert calls == ["hs-pull-r0-hash", threading.current_thread().name]
    finally:
        gate.set()
        s.close()


def test_a_fetch_that_comes_before_its_hold_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request shipping its output tokens is held in the engine step after its handle
    went out: a fetch asked first waits for the hold (``HOLD_WAIT_S``) and gets the share;
    one never held, or with a wrong nonce, is answered "unknown" after the same wait."""
    import threading
    import time

    monkeypatch.setattr(pull_server, "HOLD_WAIT_S", 0.5)
    cache = cache_of(TLH)
    nonce, tokens, blocks = make_nonce(), list(range(20)), [3, 5]
    s = server(cache, TLH, ShareChecksum.XXH3)
    try:
        answers: list[Any] = []
        early = threading.Thread(
            target=lambda: answers.append(s.answer(protocol.PullFetch(request_id="late", nonce=nonce)))
        )
        early.start()
        time.sleep(0.1)
        assert answers == []  # waiting
        s.hold("late", nonce, tokens, blocks)
        early.join(timeout=5)
        assert isinstance(answers[0], protocol.PullShare) and answers[0].block_ids == blocks
        for rid, n in (("never", nonce), ("late", make_nonce())):
            t0 = time.monotonic()
            got = s.answer(protocol.PullFetch(request_id=rid, nonce=n))
            assert isinstance(got, protocol.PullError) and got.code == "unknown"
            assert time.monotonic() - t0 >= 0.45  # the same wait for both (P2)
    finally:
        s.close()


def test_a_release_rings_the_engine_and_a_fetch_does_not() -> None:
    """A consumer's release is news for the scheduler side (its blocks go back to vLLM in
    the next step): ``on_release`` rings the doorbell that ends an idle engine's nap."""
    rings: list[str] = []
    s = server(cache_of(TLH), TLH, ShareChecksum.XXH3, on_release=lambda: rings.append("rang"))
    try:
        nonce = make_nonce()
        s.hold("req-1", nonce, list(range(TLH.block_size)), [3])
        assert isinstance(s.answer(protocol.PullFetch(request_id="req-1", nonce=nonce)), protocol.PullShare)
        assert rings == []
        got = s.answer(protocol.PullRelease(request_id="req-1", nonce=nonce))
        assert isinstance(got, protocol.PullReleased) and rings == ["rang"]
        refused = s.answer(protocol.PullRelease(request_id="req-1", nonce=nonce))  # released already
        assert isinstance(refused, protocol.PullError) and rings == ["rang"]
    finally:
        s.close()


def test_a_keep_extends_a_held_samples_clock_within_the_bound_and_says_how_long() -> None:
    """``PullKeep`` (a consumer whose fetch agent is still starting) moves the hold's
    deadline to ``timeout_s`` from now, within twice ``timeout_s`` of its finish (P8); a
    keep of a sample not held is answered as a fetch would be."""
    now = [0.0]
    s = server(cache_of(TLH), TLH, ShareChecksum.XXH3, clock=lambda: now[0])
    try:
        nonce = make_nonce()
        s.hold("req-1", nonce, list(range(TLH.block_size)), [3])
        s.finished(["req-1"])
        now[0] = 50.0
        kept = s.answer(protocol.PullKeep(request_id="req-1", nonce=nonce))
        assert kept == protocol.PullKept(request_id="req-1", held_s=60.0)
        now[0] = 100.0  # past its first deadline (60 s): still served
        assert isinstance(s.answer(protocol.PullFetch(request_id="req-1", nonce=nonce)), protocol.PullShare)
        kept = s.answer(protocol.PullKeep(request_id="req-1", nonce=nonce))
        assert kept == protocol.PullKept(request_id="req-1", held_s=20.0)  # the bound: 120 s
        now[0] = 120.0
        gone = s.answer(protocol.PullKeep(request_id="req-1", nonce=nonce))
        assert isinstance(gone, protocol.PullError) and gone.code == "expired"
    finally:
        s.close()


class Gate:
    """A step's slot check as the worker side hands it over: not done, then passed or failed."""

    def __init__(self) -> None:
        self.state: tuple[bool, str | None] = (False, None)
        self.polls = 0

    def poll(self, request_id: str) -> tuple[bool, str | None]:
        self.polls += 1
        return self.state


def test_a_sample_held_before_its_step_was_checked_is_served_only_once_the_check_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU the slot check of the step that wrote a sample runs a step late, after it is
    held: a fetch waits for the check, is served once it passed, and a sample whose check
    failed is never served; its hold ends and the consumer is told why. A wrong nonce
    learns nothing of the check."""
    import threading

    monkeypatch.setattr(pull_server, "GATE_WAIT_S", 0.3)
    cache = cache_of(LTH)
    s = server(cache, LTH, ShareChecksum.XXH3)
    nonce, tokens = make_nonce(), list(range(20))
    passes, fails, never = Gate(), Gate(), Gate()
    try:
        s.hold("ok", nonce, tokens, [3, 5], ready=passes)
        s.hold("bad", nonce, tokens, [6, 8], ready=fails)
        s.hold("slow", nonce, tokens, [1, 2], ready=never)
        threading.Timer(0.05, lambda: setattr(passes, "state", (True, None))).start()
        share = s.answer(protocol.PullFetch(request_id="ok", nonce=nonce))
        assert isinstance(share, protocol.PullShare) and passes.polls > 1  # it waited for the check
        fails.state = (False, "slot check: block 1 was written at block 9")
        forged = s.answer(protocol.PullFetch(request_id="bad", nonce=make_nonce()))
        assert isinstance(forged, protocol.PullError) and forged.code == "unknown" and not fails.polls
        refused = s.answer(protocol.PullFetch(request_id="bad", nonce=nonce))
        assert isinstance(refused, protocol.PullError) and refused.code == "failed"
        assert "block 1 was written at block 9" in refused.message
        late = s.answer(protocol.PullFetch(request_id="slow", nonce=nonce))
        assert isinstance(late, protocol.PullError) and late.code == "failed"
        assert "not checked" in late.message
        assert s.take_freed() == {"bad", "slow"}  # their blocks go back to vLLM; "ok" is held
        again = s.answer(protocol.PullFetch(request_id="ok", nonce=nonce))
        assert again == share
    finally:
        s.close()
