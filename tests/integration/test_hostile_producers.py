"""A hostile producer against a live reader, over real TCP with real NIXL agents.

Raw connections send a ``HiddenStatesReader`` random bytes, random msgpack frames,
truncated and corrupted encodings of real messages, oversize length headers, out-of-range
credit requests and Hellos for a rank that is already connected, in every handshake
phase. Each answer is checked against a model of the protocol (refuse and close,
challenge, grant, ...); after each example a fresh connection must still get a
``Challenge``, and after all of them an honest in-process ``HiddenStatesSender`` must
deliver a sample that needs the whole pool, byte-exact (no page leaked, nothing
overwritten). The protocol states themselves are proven, many more cases and
milliseconds each, against the reader's ledger and handshake in ``tests/unit``
(test_reader_ledger, test_handshake); these keep the real path honest.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_connector.reader import HiddenStatesReader
from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
from kv_connector.wire import auth, fields, handshake, protocol
from kv_connector.wire.control import FramedConnection, parse_address
from kv_connector.wire.nixl_transport import NixlTransport
from tests.integration.common import REPO, expected_states, same_bytes, token_ids
from tests.integration.hostile_common import (
    _LEN,
    CACHE,
    LAYER_IDS,
    LAYOUT,
    NUM_PAGES,
    PAGE,
    STATES,
    Expect,
    Session,
    assert_alive,
    attack,
    deliver_honestly,
    frame,
    manifest,
    model,
    msgpack_payloads,
    mutated,
    nonces,
    real_messages,
    rids,
    uid,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def reader() -> Iterator[HiddenStatesReader]:
    # The page size is fixed here so that these attacks test what they name; a refused
    # handshake choosing the page size is test_a_refused_handshake_does_not_choose_the_page_size.
    with HiddenStatesReader(pool_bytes=NUM_PAGES * PAGE, page_bytes=PAGE) as r:
        yield r


def test_random_bytes(reader: HiddenStatesReader) -> None:
    @settings(max_examples=15, deadline=None)
    @given(state=st.sampled_from(STATES), data=st.binary(max_size=2048), framed=st.booleans())
    def run(state: str, data: bytes, framed: bool) -> None:
        if framed:  # garbage behind a valid length header reaches the decoder
            data = frame(data)
        if len(data) < _LEN.size:
            expect = Expect("silent")
        else:
            (n,) = _LEN.unpack_from(data)
            body = data[_LEN.size : _LEN.size + n]
            expect = model(state, body if len(body) == n else None, n)
            if expect.kind != "silent" and len(data) > _LEN.size + n:
                expect = Expect("any")  # more frames after the first: only liveness is checked
        attack(reader, state, data, expect)

    run()
    deliver_honestly(reader)


def test_random_msgpack_frames(reader: HiddenStatesReader) -> None:
    @settings(max_examples=15, deadline=None)
    @given(state=st.sampled_from(STATES), payload=msgpack_payloads)
    def run(state: str, payload: bytes) -> None:
        attack(reader, state, frame(payload), model(state, payload))

    run()
    deliver_honestly(reader)


def test_truncated_and_corrupted_real_messages(reader: HiddenStatesReader) -> None:
    @settings(max_examples=15, deadline=None)
    @given(data=st.data(), state=st.sampled_from(STATES), msg=real_messages(), torn=st.booleans())
    def run(data: st.DataObject, state: str, msg: protocol._Msg, torn: bool) -> None:
        payload = data.draw(mutated(protocol.encode(msg)))
        if torn:  # the header promises more than we send before leaving
            declared = len(payload) + data.draw(st.integers(1, 1 << 16))
            attack(reader, state, _LEN.pack(declared) + payload, model(state, None, declared))
        else:
            attack(reader, state, frame(payload), model(state, payload))

    run()
    deliver_honestly(reader)


def test_oversize_length_headers(reader: HiddenStatesReader) -> None:
    @settings(max_examples=10, deadline=None)
    @given(
        state=st.sampled_from(STATES),
        n=st.integers(fields.MAX_FRAME_BYTES + 1, 2**32 - 1),
        tail=st.binary(max_size=64),
    )
    def run(state: str, n: int, tail: bytes) -> None:
        session = Session(reader, state)
        try:
            # Refused on the header alone: the reader must not wait for (or buffer) the body.
            session.sock.sendall(_LEN.pack(n) + tail)
            msg = session.conn.receive_one(5)
            assert isinstance(msg, protocol.Refuse) and msg.code == "protocol", msg
            assert "exceeds" in msg.message
            r, _, _ = select.select([session.sock], [], [], 5)
            assert r and session.sock.recv(1) == b"", "the reader kept the connection open"
        finally:
            session.close()
        assert_alive(reader)

    run()
    deliver_honestly(reader)


KINDS = ["valid", "block_beyond", "duplicate_block", "missing_block", "num_blocks", "dtype", "hidden_size",
         "token_id", "too_many_tokens", "grant", "ack", "hello"]  # fmt: skip


@st.composite
def hostile_credit_requests(draw: st.DrawFn) -> bytes:
    """Credit requests with out-of-range fields, and messages that only a reader may
    send (what the ledger makes of every decodable one is tests/unit/reader/push/test_ledger)."""
    rid = draw(rids)
    n = draw(st.sampled_from([1, 16, 17, 767, 769, 1 << 17]))
    m = msgspec.to_builtins(manifest(rid, n))
    blocks = list(range(m["num_blocks"]))
    what = draw(st.sampled_from(KINDS))
    if what == "block_beyond":
        blocks.append(len(blocks) + draw(st.integers(0, 1 << 20)))
    elif what == "duplicate_block":
        blocks.append(blocks[0])
    elif what == "missing_block":
        blocks.pop()
    elif what == "num_blocks":
        m["num_blocks"] += 1
    elif what == "dtype":
        m["geometry"]["dtype"] = "float64"
    elif what == "hidden_size":
        m["geometry"]["hidden_size"] = (1 << 20) + 1
    elif what == "token_id":
        m["token_ids"][-1] = -1
    elif what == "too_many_tokens":
        big = fields.MAX_TOKENS + 1
        m["token_ids"], m["geometry"]["block_size"], m["num_blocks"] = (
            [1] * big,
            1 << 16,
            -(-big // (1 << 16)),
        )
        blocks = list(range(m["num_blocks"]))
    if what == "grant":
        return protocol.encode(protocol.Grant(request_id=rid, first_page=0, num_pages=2, generation=1))
    if what == "ack":
        return protocol.encode(protocol.Ack(request_id=rid))
    if what == "hello":
        return protocol.encode(
            protocol.Hello(
                version=protocol.PROTOCOL_VERSION, producer_id=uid("again"), rank=0, world_size=1,
                agent_name="a", block_bytes=PAGE, nonce=bytes(32),
            )
        )  # fmt: skip
    return msgspec.msgpack.encode({"type": "credit_request", "manifest": m, "blocks": blocks})


def test_out_of_range_fields_from_an_authenticated_producer(reader: HiddenStatesReader) -> None:
    @settings(max_examples=15, deadline=None)
    @given(payload=hostile_credit_requests())
    def run(payload: bytes) -> None:
        attack(reader, "ready", frame(payload), model("ready", payload))

    run()
    deliver_honestly(reader)


def test_a_second_hello_for_a_connected_rank_is_refused(reader: HiddenStatesReader) -> None:
    victim_id = uid("victim")
    victim = HiddenStatesSender(
        SenderConfig(reader.address, victim_id, connect_timeout_s=10), CACHE, LAYOUT, LAYER_IDS
    )
    try:
        assert victim.connected.wait(10)

        @settings(max_examples=10, deadline=None)
        @given(
            rank=st.integers(0, 3),
            world_size=st.integers(1, 4),
            nonce=nonces,
            same_agent=st.booleans(),
            after_handshake=st.booleans(),
        )
        def run(rank: int, world_size: int, nonce: bytes, same_agent: bool, after_handshake: bool) -> None:
            hello = protocol.Hello(
                version=protocol.PROTOCOL_VERSION,
                producer_id=victim_id,
                rank=rank,
                world_size=world_size,
                agent_name=victim.agent_name if same_agent else uid("impostor"),
                block_bytes=PAGE,
                nonce=nonce,
            )
            if after_handshake:  # a second Hello on a connection of its own that is ready
                expect = Expect("refuse", {"match": "unexpected Hello"})
                attack(reader, "ready", frame(protocol.encode(hello)), expect)
            else:
                if world_size != 1:
                    expect = Expect("refuse", {"match": "world size"})
                elif rank >= world_size:
                    expect = Expect("refuse", {"match": "outside world size"})
                else:
                    expect = Expect("refuse", {"match": "already connected"})
                attack(reader, "fresh", frame(protocol.encode(hello)), expect)

        run()
        # The victim's own connection was never disturbed: it still ships.
        rid = uid("victim-sample")
        victim.ship(rid, token_ids(rid, 40), [4, 8, 15])
        got = reader.get(timeout=20, copy=True)
        assert got.request_id == rid and got.producer_id == victim_id
        assert same_bytes(got.hidden_states, expected_states(CACHE, LAYOUT, [4, 8, 15], 40))
        assert not victim.take_failed()
    finally:
        victim.close()
    deliver_honestly(reader)


def test_replaying_a_connected_producers_agent_metadata_is_refused(reader: HiddenStatesReader) -> None:
    victim_id = uid("victim")
    transport = NixlTransport(f"{victim_id}-r0-{os.getpid()}")  # ours: its metadata is the one replayed
    victim = HiddenStatesSender(
        SenderConfig(reader.address, victim_id, connect_timeout_s=10),
        CACHE,
        LAYOUT,
        LAYER_IDS,
        transport=transport,
    )
    try:
        assert victim.connected.wait(10)
        conn = FramedConnection(socket.create_connection(parse_address(reader.address), timeout=5))
        try:
            nonce = auth.make_nonce()
            pid = uid("replayer")
            conn.send(
                protocol.Hello(
                    version=protocol.PROTOCOL_VERSION,
                    producer_id=pid,
                    rank=0,
                    world_size=1,
                    agent_name=victim.agent_name,
                    block_bytes=PAGE,
                    nonce=nonce,
                )
            )
            ch = conn.receive_one(5)
            assert isinstance(ch, protocol.Challenge)
            proof = auth.proof(None, "producer", pid, 0, nonce, ch.nonce)
            conn.send(protocol.Auth(proof=proof, agent_metadata=transport.metadata))
            msg = conn.receive_one(5)
            assert isinstance(msg, protocol.Refuse) and "in use" in msg.message, msg
        finally:
            conn.close()
        rid = uid("after-replay")
        victim.ship(rid, token_ids(rid, 33), [1, 2, 3])
        got = reader.get(timeout=20, copy=True)
        assert same_bytes(got.hidden_states, expected_states(CACHE, LAYOUT, [1, 2, 3], 33))
    finally:
        victim.close()
    deliver_honestly(reader)


# ------------------------------------------------------ reader robustness
def test_a_refused_handshake_does_not_choose_the_page_size() -> None:
    pool = 16 * PAGE
    with HiddenStatesReader(pool_bytes=pool) as reader:  # page size: the first producer's block
        conn = FramedConnection(socket.create_connection(parse_address(reader.address), timeout=5))
        try:
            conn.send(
                protocol.Hello(
                    version=protocol.PROTOCOL_VERSION,
                    producer_id="squatter",
                    rank=0,
                    world_size=1,
                    agent_name="squatter",
                    block_bytes=pool * 4,
                    nonce=auth.make_nonce(),
                )
            )
            assert isinstance(conn.receive_one(5), protocol.Challenge)
            conn.send(protocol.Auth(proof=bytes(32), agent_metadata=b"not NIXL metadata"))
            msg = conn.receive_one(5)
            assert isinstance(msg, protocol.Refuse) and "metadata" in msg.message
        finally:
            conn.close()
        sender = HiddenStatesSender(SenderConfig(reader.address, uid("honest")), CACHE, LAYOUT, LAYER_IDS)
        try:
            sender.ship("after-squatter", token_ids("after-squatter", 40), [3, 4, 5])
            got = None
            deadline = time.monotonic() + 10
            while got is None:
                failed = sender.take_failed()
                assert not failed, f"the honest producer's 3-block sample was refused: {failed}"
                assert time.monotonic() < deadline, "the honest producer's sample never arrived"
                with contextlib.suppress(TimeoutError):
                    got = reader.get(timeout=0.1, copy=True)
            assert same_bytes(got.hidden_states, expected_states(CACHE, LAYOUT, [3, 4, 5], 40))
        finally:
            sender.close()


@pytest.mark.parametrize("sent", ["nothing", "hello"])
def test_a_connection_that_never_finishes_its_handshake_is_closed(
    sent: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT_S", 1.0)
    with HiddenStatesReader(pool_bytes=NUM_PAGES * PAGE, page_bytes=PAGE) as reader:
        sock = socket.create_connection(parse_address(reader.address), timeout=5)
        try:
            hello = protocol.encode(
                protocol.Hello(
                    version=protocol.PROTOCOL_VERSION,
                    producer_id="idle",
                    rank=0,
                    world_size=1,
                    agent_name="idle",
                    block_bytes=PAGE,
                    nonce=auth.make_nonce(),
                )
            )
            if sent == "half-a-frame":
                sock.sendall(frame(hello)[:10])
            elif sent == "hello":
                sock.sendall(frame(hello))
            deadline = time.monotonic() + 4.0
            closed = False
            while not closed and time.monotonic() < deadline:
                r, _, _ = select.select([sock], [], [], 0.2)
                if r:
                    try:
                        closed = sock.recv(1 << 16) == b""
                    except ConnectionResetError:
                        closed = True
            assert closed, "the reader still holds a connection that stalled in its handshake"
        finally:
            sock.close()
        assert_alive(reader)


LOW_FD_READER = """
import os, resource, sys, time
from kv_connector.reader import HiddenStatesReader
r = HiddenStatesReader(pool_bytes=1 << 20, page_bytes=1 << 14)
n = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 16, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(r.address, flush=True)
sys.stdin.read()
"""


def test_a_connection_flood_does_not_kill_the_reader() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", LOW_FD_READER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, proc.stderr.read() if proc.stderr else ""
        host, port = parse_address(address)
        for _ in range(48):  # three times what the reader may hold open
            socks.append(socket.create_connection((host, port), timeout=5))
        time.sleep(1.0)
        for s in socks:
            s.close()
        socks.clear()
        time.sleep(0.5)
        conn = FramedConnection(socket.create_connection((host, port), timeout=5), send_timeout=5)
        try:
            conn.send(
                protocol.Hello(
                    version=protocol.PROTOCOL_VERSION,
                    producer_id="after-flood",
                    rank=0,
                    world_size=1,
                    agent_name="after-flood",
                    block_bytes=PAGE,
                    nonce=auth.make_nonce(),
                )
            )
            try:
                msg = conn.receive_one(3)
            except TimeoutError:
                pytest.fail("the reader stopped serving after running out of file descriptors")
            assert isinstance(msg, protocol.Challenge)
        finally:
            conn.close()
        assert proc.poll() is None
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.communicate()
