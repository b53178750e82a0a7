"""Holes that hostile or unlucky peers found between real processes, each closed at its
root (docs/reliability.md lists them): request ids that cannot travel, samples without a
deadline, a sender thread that died while saying "connected", a producer that stops
reading, pre-authentication resources, unbounded queues, and preemption while a share
is not safely written. The ledgers' rules are proven case by case in tests/unit; these
run the real sender, reader and NIXL."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kv_connector.producer.idle_steps import IdleSteps
from kv_connector.reader import HiddenStatesReader
from kv_connector.reader.push.ledger import MAX_PENDING_PER_RANK
from kv_connector.reader.push.server import MAX_UNPROVEN_PER_HOST
from kv_connector.sender.loop import SenderError
from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
from kv_connector.wire import protocol
from kv_connector.wire.control import FramedConnection, parse_address
from kv_connector.wire.nixl_transport import NixlTransport
from tests.integration.common import (
    expected_states,
    finish_sender,
    layout_dict,
    same_bytes,
    start_sender,
    token_ids,
)
from tests.integration.hostile_common import (
    CACHE,
    LAYER_IDS,
    LAYOUT,
    NUM_CACHE_BLOCKS,
    NUM_PAGES,
    PAGE,
    FakeReader,
    Session,
    assert_alive,
    challenge_for,
    deliver_honestly,
    ship_to_fake,
    uid,
    welcome_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def reader() -> Iterator[HiddenStatesReader]:
    with HiddenStatesReader(pool_bytes=NUM_PAGES * PAGE, page_bytes=PAGE) as r:
        yield r


def sender_to(address: str, pid: str | None = None, **kw: Any) -> HiddenStatesSender:
    return HiddenStatesSender(
        SenderConfig(address, pid or uid("p"), connect_timeout_s=kw.pop("connect_timeout_s", 10), **kw),
        CACHE,
        LAYOUT,
        LAYER_IDS,
    )


def wait_outcome(
    sender: HiddenStatesSender, rids: set[str], timeout: float = 30
) -> tuple[set[str], dict[str, str]]:
    finished: set[str] = set()
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while (finished | set(failed)) < rids:
        assert time.monotonic() < deadline, f"no outcome for {rids - finished - set(failed)}"
        finished |= sender.take_finished()
        failed.update({rid: f.why for rid, f in sender.take_failed().items()})
        time.sleep(0.005)
    return finished, failed


# ------------------------------------------------------------------ request ids (1)
@pytest.mark.parametrize("bad", ["a b", "x/../y", "z" * 257, "newline\n", ""])
def test_a_request_id_that_cannot_travel_is_refused_alone(reader: HiddenStatesReader, bad: str) -> None:
    """Before: the reader refused the producer's whole connection, the sender resent
    everything for the bad job's lifetime (120 reconnects in 5 s) and lost a valid sample
    in the same batch. Now ``ship`` refuses it, and nothing else notices."""
    sender = sender_to(reader.address)
    try:
        good = [uid("before"), uid("after")]
        sender.ship(good[0], token_ids(good[0], 20), [1, 2])
        with pytest.raises(ValueError, match="cannot name a sample"):
            sender.ship(bad, token_ids("x", 20), [3, 4])
        sender.ship(good[1], token_ids(good[1], 20), [5, 6])
        got = {reader.get(timeout=30, copy=True).request_id for _ in good}
        assert got == set(good)
        finished, failed = wait_outcome(sender, set(good))
        assert finished == set(good) and not failed
        assert sender.stats().reconnects == 0 and reader.stats().refused == 0
    finally:
        sender.close()


# ------------------------------------------------------------------- deadlines (2)
@pytest.mark.parametrize("who", ["reader", "sender"])
def test_a_sample_a_rank_can_never_complete_gives_its_pages_back(tmp_path: Any, who: str) -> None:
    """TP=2, rank 1 cannot reach the reader. Before: rank 0's job and the reader's pages
    were held until the producer disconnected. Now the deadline of either side (the
    reader's ``sample_timeout_s``, or the sender's) fails the sample on both sides, its
    pages come back, and a sample that needs the whole pool is delivered after it."""
    short = 3.0
    with HiddenStatesReader(
        pool_bytes=NUM_PAGES * PAGE, page_bytes=PAGE, sample_timeout_s=short if who == "reader" else 300
    ) as reader:
        dead = socket.socket()  # bound, never listening: connections are refused
        dead.bind(("127.0.0.1", 0))
        try:
            rid, n = uid("never-complete"), 4 * LAYOUT.block_size
            blocks = list(range(4))
            sample = {"request_id": rid, "num_tokens": n, "block_ids": blocks}
            common = dict(
                layout=layout_dict(LAYOUT), num_cache_blocks=NUM_CACHE_BLOCKS, seed=21,
                producer_id=uid("tp2"), world_size=2, samples=[sample], timeout_s=60,
                sample_timeout_s=short if who == "sender" else 300,
            )  # fmt: skip
            ranks = [
                start_sender({**common, "rank": 0, "address": reader.address, "connect_timeout_s": 60}),
                start_sender(
                    {
                        **common,
                        "rank": 1,
                        "address": f"127.0.0.1:{dead.getsockname()[1]}",
                        "connect_timeout_s": 2,
                    }
                ),
            ]
            r0, r1 = (finish_sender(p, timeout=90) for p in ranks)
        finally:
            dead.close()
        assert "cannot reach the reader" in r1["failed"][rid]
        why = r0["failed"][rid]
        if who == "reader":
            assert "refused (timeout)" in why and "ranks [1] missing" in why, why
            assert reader.stats().refused == 1
        else:
            assert "not acknowledged 3 s after its pages were granted" in why, why
        deliver_honestly(reader)  # its pages are back: a whole-pool sample arrives


# ------------------------------------------------------------- a dead thread (3)
def test_a_welcome_that_would_overflow_the_transport_is_a_clear_failure() -> None:
    """Before: a Welcome with pool_addr 2**64 - 1 (valid for the field) killed the sender
    thread with OverflowError; the sender said "connected" and the request hung."""
    agent = NixlTransport(uid("overflow-agent"))
    try:
        region = agent.register(torch.zeros(4 * PAGE, dtype=torch.uint8))

        def respond(fake: FakeReader, conn: FramedConnection, hello: protocol.Message) -> None:
            conn.send(challenge_for(hello))
            fake.recv(conn)
            w = welcome_for(agent, region)
            raw = protocol.encode(w).replace(
                w.pool_addr.to_bytes(8, "big"), ((1 << 64) - 1).to_bytes(8, "big")
            )
            conn.sock.sendall(len(raw).to_bytes(4, "big") + raw)
            time.sleep(0.3)

        fake = FakeReader(respond)
        try:
            reason = ship_to_fake(fake)
        finally:
            fake.close()
        assert "64-bit" in reason, reason
    finally:
        agent.close()


class BuggyAgent(NixlTransport):
    """Fault injection: loading a reader's metadata raises an error nobody expects."""

    def add_peer(self, metadata: bytes) -> str:
        raise RuntimeError("injected bug")


def test_a_sender_thread_that_dies_says_so_and_refuses_new_work(reader: HiddenStatesReader) -> None:
    """A bug in the sender thread: its death is visible. The link error names it,
    ``connected`` is never set, what it held failed, and ``ship`` fails fast."""
    sender = HiddenStatesSender(
        SenderConfig(reader.address, uid("buggy"), connect_timeout_s=60),
        CACHE,
        LAYOUT,
        LAYER_IDS,
        transport=BuggyAgent(uid("buggy-agent")),
    )
    try:
        rid = uid("held")
        sender.ship(rid, token_ids(rid, 20), [1, 2])
        _, failed = wait_outcome(sender, {rid}, timeout=10)  # not after connect_timeout_s (60 s)
        assert "the sender thread failed: RuntimeError: injected bug" in failed[rid]
        assert sender.link_error is not None and "injected bug" in sender.link_error
        assert not sender.connected.is_set()
        with pytest.raises(SenderError, match="injected bug"):
            sender.ship(uid("late"), token_ids("late", 20), [3, 4])
    finally:
        sender.close()
    assert_alive(reader)


# ------------------------------------------------------- a producer that stops reading (4)
def test_a_producer_that_stops_reading_does_not_freeze_the_reader() -> None:
    """An authenticated producer floods requests the reader must answer (each refused:
    too big for the pool) and never reads. Before: the reader's blocking send held its
    lock for 30 s and an honest producer waited that long for its Challenge. Now output
    to a peer is queued without blocking and a peer over its output bound is dropped."""
    with HiddenStatesReader(pool_bytes=2 * PAGE, page_bytes=PAGE) as reader:
        flood = Session(reader, "ready")
        try:
            flood.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            m = protocol.Manifest(
                request_id="too-big",
                token_ids=list(range(48)),
                layer_ids=LAYER_IDS,
                geometry=LAYOUT,
                num_blocks=3,
            )
            frames = bytearray()
            for i in range(40_000):
                req = protocol.CreditRequest(
                    manifest=protocol.Manifest(
                        request_id=f"too-big-{i}", token_ids=m.token_ids, layer_ids=m.layer_ids,
                        geometry=m.geometry, num_blocks=3,
                    ),
                    blocks=[0, 1, 2],
                )  # fmt: skip
                data = protocol.encode(req)
                frames += len(data).to_bytes(4, "big") + data
            sent = threading.Event()

            def push() -> None:
                with contextlib.suppress(OSError):  # dropped by the reader: what we want
                    flood.sock.sendall(frames)
                sent.set()

            t = threading.Thread(target=push, daemon=True)
            t.start()
            time.sleep(0.5)  # the reader is answering into a socket nobody reads
            worst = 0.0
            for _ in range(5):
                t0 = time.monotonic()
                assert_alive(reader)  # a new producer's Hello gets its Challenge
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.2)
            assert worst < 3.0, f"an honest Hello waited {worst:.1f} s behind a producer that does not read"
            t.join(30)
        finally:
            flood.close()
        deliver_honestly_small(reader)


def deliver_honestly_small(reader: HiddenStatesReader) -> None:
    sender = sender_to(reader.address)
    try:
        rid = uid("after-flood")
        sender.ship(rid, token_ids(rid, 20), [7, 9])
        got = reader.get(timeout=30, copy=True)
        assert got.request_id == rid
        assert same_bytes(got.hidden_states, expected_states(CACHE, LAYOUT, [7, 9], 20))
    finally:
        sender.close()


# ------------------------------------------------------ resources before proof (5)
def test_idle_unproven_connections_are_capped_per_host(reader: HiddenStatesReader) -> None:
    """Before: 328 idle connections (fd limit 256) locked everyone out until they went.
    Now one host may hold at most MAX_UNPROVEN_PER_HOST connections that have not proven
    anything; more are closed at once, and the reader serves the others meanwhile."""
    host, port = parse_address(reader.address)
    idle = [socket.create_connection((host, port), timeout=5) for _ in range(MAX_UNPROVEN_PER_HOST + 20)]
    try:
        time.sleep(1.0)
        closed = 0
        for s in idle:
            s.settimeout(0.01)
            try:
                if s.recv(1) == b"":
                    closed += 1
            except (TimeoutError, BlockingIOError):
                pass
            except OSError:
                closed += 1
        assert closed >= 20, f"only {closed} of the connections over the cap were closed"
    finally:
        for s in idle:
            s.close()
    assert_alive(reader)


# ---------------------------------------------------------------- bounds (6)
def test_a_producer_over_its_pending_bound_is_dropped_and_the_others_go_on() -> None:
    with HiddenStatesReader(pool_bytes=2 * PAGE, page_bytes=PAGE) as reader:
        s = Session(reader, "ready")
        try:
            frames = bytearray()
            for i in range(MAX_PENDING_PER_RANK + 10):  # the bound itself, passed
                m = protocol.Manifest(
                    request_id=f"q{i}",
                    token_ids=list(range(16)),
                    layer_ids=LAYER_IDS,
                    geometry=LAYOUT,
                    num_blocks=1,
                )
                data = protocol.encode(protocol.CreditRequest(manifest=m, blocks=[0]))
                frames += len(data).to_bytes(4, "big") + data
            got = s.exchange(bytes(frames))
        finally:
            s.close()
        refusals = [m for m in got if isinstance(m, protocol.Refuse) and not m.request_id]
        assert refusals and "over its bound" in refusals[-1].message, got[-3:]
        deliver_honestly_small(reader)


# ---------------------------------------------------------------- preemption (9)
def test_a_preempted_request_waiting_for_pages_fails_in_bounded_time_and_never_arrives() -> None:
    """Before: handle_preemptions held the engine step up to drain_timeout_s (60 s) while
    the reader was full, then let the blocks be reused under a queued WRITE. Now the
    share gets ``timeout`` to be written; it is not (the pool is held by a lease), so the
    request fails, the reader drops it, and it never arrives, even once pages are free."""
    with HiddenStatesReader(pool_bytes=4 * PAGE, page_bytes=PAGE) as reader:
        sender = sender_to(reader.address)
        try:
            hold = uid("hold")
            sender.ship(hold, token_ids(hold, 4 * LAYOUT.block_size), [0, 1, 2, 3])
            held = reader.get(timeout=30)  # on lease: the pool is full
            victim = uid("victim")
            sender.ship(victim, token_ids(victim, 20), [8, 9])
            time.sleep(0.3)  # its credit request is queued at the reader
            t0 = time.monotonic()
            failed = sender.preempt([victim, hold], timeout=0.5)
            waited = time.monotonic() - t0
            assert failed == [victim] and 0.4 < waited < 3.0, (failed, waited)
            _, outcome = wait_outcome(sender, {victim})
            assert "preempted" in outcome[victim]
            held.release()
            with pytest.raises(TimeoutError):
                reader.get(timeout=2.0)
            ok = uid("after")
            sender.ship(ok, token_ids(ok, 20), [10, 11])
            assert reader.get(timeout=30, copy=True).request_id == ok
        finally:
            sender.close()


# ------------------------------------------------- an idle engine learns of outcomes at once
def test_each_outcome_rings_the_engine_so_its_nap_ends_and_the_blocks_go_back() -> None:
    """A producer whose cache is full of samples waiting for their reader takes empty
    steps with naps of up to 25 ms in between. Before: an ack that came during a nap waited
    for its end before vLLM freed the sample's blocks (the data-path bench's writer sat
    idle for want of granted samples). Now the sender rings the scheduler side's doorbell
    on every ack and refusal, and the nap ends there (a 60 s nap here)."""
    idle = IdleSteps(first_s=60.0, longest_s=60.0)
    with HiddenStatesReader(pool_bytes=NUM_PAGES * PAGE, page_bytes=PAGE, ack="manual") as reader:
        sender = sender_to(reader.address, on_outcome=idle.bell.set)
        try:
            kept, refused = uid("kept"), uid("refused")
            for rid, blocks in ((kept, [1, 2]), (refused, [3, 4])):
                sender.ship(rid, token_ids(rid, 20), blocks)
                sample = reader.get(timeout=30)
                assert not idle.bell.is_set()  # handed out, not acknowledged yet
                if rid == kept:
                    reader.ack(sample)
                else:
                    reader.reject(sample, "the trainer cannot use it")
                sample.release()
                t0 = time.monotonic()
                assert idle.rest(0) is True  # the ack, then the refusal, ended a 60 s nap
                assert time.monotonic() - t0 < 30
            finished, failed = wait_outcome(sender, {kept, refused})
            assert finished == {kept} and "the trainer cannot use it" in failed[refused]
        finally:
            sender.close()
