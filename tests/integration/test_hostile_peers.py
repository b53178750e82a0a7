"""Hostile peers against a live reader, and a hostile "reader" against a real sender.

Raw TCP connections send a ``HiddenStatesReader`` random bytes, random msgpack frames,
truncated and corrupted encodings of real messages, oversize length headers, out-of-range
credit requests and Hellos for a rank that is already connected, in every handshake state.
Each answer is checked against a model of the protocol (refuse and close, challenge,
grant, ...); after each example a fresh connection must still get a ``Challenge``, and
after all of them an honest in-process ``HiddenStatesSender`` must deliver a sample that
needs the whole pool, byte-exact (no page leaked, nothing overwritten).

The other way round, a plain TCP server speaking our framing answers a real
``HiddenStatesSender`` with garbage or invalid handshake and credit messages: the sender
must fail its request with a clear reason, in bounded time, without crashing.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_connector import auth, protocol
from kv_connector.control import FramedConnection, parse_address
from kv_connector.layout import BlockLayout
from kv_connector.protocol import ProtocolError
from kv_connector.reader import HiddenStatesReader
from kv_connector.reader import core as reader_core
from kv_connector.sender import HiddenStatesSender, SenderConfig
from kv_connector.transport import Transport
from tests.integration.common import REPO, expected_states, make_cache, same_bytes, token_ids

pytestmark = pytest.mark.integration

LAYOUT = BlockLayout("LTH", 16, 3, 64, "float32")
PAGE = LAYOUT.block_bytes
NUM_PAGES = 48
NUM_CACHE_BLOCKS = 64
LAYER_IDS = list(range(LAYOUT.num_layers))
STATES = ("fresh", "hello", "ready")
_LEN = struct.Struct(">I")
_ids = itertools.count()
CACHE = make_cache(LAYOUT, NUM_CACHE_BLOCKS, seed=21)


def uid(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


def frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


def parse_frames(data: bytes) -> list[protocol.Message]:
    """The reader's answers: whole frames of valid messages, nothing else."""
    out = []
    while data:
        assert len(data) >= _LEN.size, f"a torn frame header from the reader: {data!r}"
        (n,) = _LEN.unpack_from(data)
        assert len(data) >= _LEN.size + n, "a torn frame from the reader"
        out.append(protocol.decode(data[_LEN.size : _LEN.size + n]))
        data = data[_LEN.size + n :]
    return out


@pytest.fixture
def reader() -> Iterator[HiddenStatesReader]:
    # The page size is fixed here so that these attacks test what they name; a refused
    # handshake choosing the page size is test_a_refused_handshake_does_not_choose_the_page_size.
    with HiddenStatesReader(pool_bytes=NUM_PAGES * PAGE, page_bytes=PAGE) as r:
        yield r


# --------------------------------------------------------------- raw sessions
class Session:
    """A raw control connection brought to a handshake state: "fresh" (nothing sent),
    "hello" (Hello sent, Challenge received) or "ready" (a real NIXL agent's Auth sent,
    Welcome received)."""

    def __init__(self, reader: HiddenStatesReader, state: str) -> None:
        self.pid = uid("hostile")
        self.transport: Transport | None = None
        self.welcome: protocol.Welcome | None = None
        host, port = parse_address(reader.address)
        self.sock = socket.create_connection((host, port), timeout=10)
        self.conn = FramedConnection(self.sock, send_timeout=10)
        try:
            if state in ("hello", "ready"):
                self.transport = Transport(f"{self.pid}-agent")
                self.nonce = auth.make_nonce()
                self.conn.send(
                    protocol.Hello(
                        version=protocol.PROTOCOL_VERSION,
                        producer_id=self.pid,
                        rank=0,
                        world_size=1,
                        agent_name=self.transport.name,
                        block_bytes=PAGE,
                        nonce=self.nonce,
                    )
                )
                ch = self.conn.receive_one(10)
                assert isinstance(ch, protocol.Challenge), ch
                self.challenge = ch
            if state == "ready":
                assert self.transport is not None
                digest = auth.proof(None, "producer", self.pid, 0, self.nonce, self.challenge.nonce)
                self.conn.send(protocol.Auth(digest=digest, agent_metadata=self.transport.metadata))
                w = self.conn.receive_one(10)
                assert isinstance(w, protocol.Welcome), w
                self.welcome = w
        except BaseException:
            self.close()
            raise

    def exchange(self, data: bytes, timeout: float = 20.0) -> list[protocol.Message]:
        """Send ``data``, close our side, and return every frame the reader sent back
        before it closed the connection (it must close it: we are gone)."""
        try:
            self.sock.sendall(data)
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the reader refused and closed before taking everything
        got = bytearray()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, "the reader neither answered nor closed the connection"
            r, _, _ = select.select([self.sock], [], [], left)
            if not r:
                continue
            try:
                chunk = self.sock.recv(1 << 20)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        return parse_frames(bytes(got))

    def close(self) -> None:
        self.conn.close()
        if self.transport is not None:
            self.transport.close()


def assert_alive(reader: HiddenStatesReader) -> None:
    """The serving thread runs and a new connection's Hello gets its Challenge."""
    assert reader._thread.is_alive(), "the reader's serving thread died"
    host, port = parse_address(reader.address)
    conn = FramedConnection(socket.create_connection((host, port), timeout=5), send_timeout=5)
    try:
        pid = uid("alive")
        conn.send(
            protocol.Hello(
                version=protocol.PROTOCOL_VERSION,
                producer_id=pid,
                rank=0,
                world_size=1,
                agent_name=f"{pid}-agent",
                block_bytes=PAGE,
                nonce=auth.make_nonce(),
            )
        )
        assert isinstance(conn.receive_one(5), protocol.Challenge)
    finally:
        conn.close()


def deliver_honestly(reader: HiddenStatesReader) -> None:
    """An honest in-process sender ships a sample that needs every page of the pool, then
    a small one; both arrive byte-exact and are acknowledged."""
    sender = HiddenStatesSender(
        SenderConfig(reader.address, uid("honest"), connect_timeout_s=10), CACHE, LAYOUT, LAYER_IDS
    )
    try:
        rng = random.Random(5)
        for rid, n in [(uid("whole-pool"), NUM_PAGES * LAYOUT.block_size), (uid("small"), 21)]:
            blocks = rng.sample(range(NUM_CACHE_BLOCKS), -(-n // LAYOUT.block_size))
            sender.ship(rid, token_ids(rid, n), blocks)
            got = reader.get(timeout=30)
            assert got.request_id == rid
            assert got.token_ids.tolist() == token_ids(rid, n)
            assert same_bytes(got.hidden_states, expected_states(CACHE, LAYOUT, blocks, n))
            deadline = time.monotonic() + 10
            while rid not in sender.take_finished():
                assert time.monotonic() < deadline, f"{rid} was never acknowledged"
                assert not sender.take_failed()
                time.sleep(0.005)
    finally:
        sender.close()


# ------------------------------------------------------------ the reader model
@dataclass
class Expect:
    """What the reader must answer to one frame."""

    kind: str  # refuse | silent | challenge | auth | grant | pool_too_small | any
    detail: dict[str, Any] = field(default_factory=dict)


def model(state: str, payload: bytes | None, declared: int | None = None) -> Expect:
    """The reader's answer to one frame of ``payload`` (``declared`` overrides its length
    header; ``payload`` None: the frame is incomplete when we close)."""
    n = len(payload) if payload is not None and declared is None else declared
    if n is not None and n > protocol.MAX_FRAME_BYTES:
        return Expect("refuse", {"match": "exceeds"})
    if payload is None or n != len(payload):
        return Expect("silent")
    try:
        msg = protocol.decode(payload)
    except ProtocolError:
        return Expect("refuse")
    if state == "fresh":
        if not isinstance(msg, protocol.Hello):
            return Expect("refuse", {"match": "expected hello"})
        if msg.rank >= msg.world_size:
            return Expect("refuse", {"match": "outside world size"})
        return Expect("challenge")
    if state == "hello":
        if not isinstance(msg, protocol.Auth):
            return Expect("refuse", {"match": "expected auth"})
        return Expect("auth")  # Welcome only for metadata NIXL loads under the hello's name
    if isinstance(msg, protocol.Refuse):
        return Expect("silent")  # logged; the connection stays until we leave
    if not isinstance(msg, protocol.CreditRequest):
        return Expect("refuse", {"match": "unexpected"})
    m = msg.manifest
    ppb = math.ceil(m.block_bytes / PAGE)
    if m.num_blocks * ppb > NUM_PAGES:
        return Expect("pool_too_small", {"request_id": m.request_id})
    if set(msg.blocks) != set(range(m.num_blocks)):
        return Expect("refuse", {"match": "unwritten"})
    return Expect("grant", {"request_id": m.request_id, "ppb": ppb, "pages": m.num_blocks * ppb})


def check(expect: Expect, got: list[protocol.Message]) -> None:
    k = expect.kind
    if k == "any":
        return
    if k == "silent":
        assert got == [], got
    elif k == "refuse":
        assert len(got) == 1 and isinstance(got[0], protocol.Refuse), got
        assert got[0].code == "protocol" and got[0].request_id == ""
        assert expect.detail.get("match", "") in got[0].message, got[0].message
    elif k == "challenge":
        assert len(got) == 1 and isinstance(got[0], protocol.Challenge), got
        assert not got[0].auth_required
    elif k == "auth":
        assert len(got) == 1 and isinstance(got[0], (protocol.Welcome, protocol.Refuse)), got
    elif k == "pool_too_small":
        assert len(got) == 1 and isinstance(got[0], protocol.Refuse), got
        assert got[0].code == "pool_too_small" and got[0].request_id == expect.detail["request_id"]
    elif k == "grant":
        assert len(got) == 1 and isinstance(got[0], protocol.Grant), got
        g = got[0]
        assert g.request_id == expect.detail["request_id"] and g.pages_per_block == expect.detail["ppb"]
        assert len(g.pages) == expect.detail["pages"] == len(set(g.pages))
        assert all(0 <= p < NUM_PAGES for p in g.pages)
    else:  # pragma: no cover
        raise AssertionError(k)


def attack(reader: HiddenStatesReader, state: str, data: bytes, expect: Expect) -> None:
    session = Session(reader, state)
    try:
        got = session.exchange(data)
    finally:
        session.close()
    check(expect, got)
    assert_alive(reader)


# ----------------------------------------------------------------- strategies
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
    max_leaves=20,
)
TAGS = ["hello", "challenge", "auth", "welcome", "credit_request", "grant", "ack", "refuse", "write_done"]
FIELDS = sorted(
    {f for cls in (*protocol.Message.__args__, protocol.Manifest) for f in cls.__struct_fields__}  # type: ignore[attr-defined]
)
tagged = st.builds(
    lambda tag, d: {**d, "type": tag},
    st.sampled_from([*TAGS, "bogus"]),
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), values, max_size=9),
)
msgpack_payloads = st.one_of(values, tagged).map(msgspec.msgpack.encode)
nonces = st.binary(min_size=32, max_size=32)
rids = st.from_regex(r"[A-Za-z0-9_.:@+=\-]{1,24}", fullmatch=True)


def manifest(rid: str, n: int, bs: int = LAYOUT.block_size, **kw: Any) -> protocol.Manifest:
    fields: dict[str, Any] = dict(
        request_id=rid,
        token_ids=token_ids(rid, n),
        layer_ids=LAYER_IDS,
        hidden_size=LAYOUT.hidden_size,
        dtype=LAYOUT.dtype,
        layout=LAYOUT.layout,
        block_size=bs,
        num_blocks=-(-n // bs),
        block_bytes=LAYOUT.block_bytes // LAYOUT.block_size * bs,
    )
    fields.update(kw)
    return protocol.Manifest(**fields)


@st.composite
def real_messages(draw: st.DrawFn) -> protocol._Msg:
    """A valid message of any type (what is valid depends on the state)."""
    rid = draw(rids)
    kind = draw(st.sampled_from(TAGS))
    if kind == "hello":
        return protocol.Hello(
            version=protocol.PROTOCOL_VERSION,
            producer_id=uid("mutant"),
            rank=0,
            world_size=draw(st.integers(1, 4)),
            agent_name=uid("agent"),
            block_bytes=PAGE,
            nonce=draw(nonces),
        )
    if kind == "challenge":
        return protocol.Challenge(
            version=protocol.PROTOCOL_VERSION, nonce=draw(nonces), digest=draw(nonces), auth_required=False
        )
    if kind == "auth":
        return protocol.Auth(digest=draw(nonces), agent_metadata=draw(st.binary(max_size=200)))
    if kind == "welcome":
        return protocol.Welcome(
            reader_id="r",
            agent_name="a",
            agent_metadata=b"m",
            pool_addr=1 << 30,
            pool_bytes=PAGE,
            page_bytes=PAGE,
            num_pages=1,
            mem_type="DRAM",
            device_id=0,
        )
    if kind == "credit_request":
        n = draw(st.integers(1, 6 * LAYOUT.block_size))
        return protocol.CreditRequest(
            manifest=manifest(rid, n), blocks=list(range(-(-n // LAYOUT.block_size)))
        )
    if kind == "grant":
        return protocol.Grant(
            request_id=rid, pages=draw(st.lists(st.integers(0, 99), min_size=1)), pages_per_block=1
        )
    if kind == "ack":
        return protocol.Ack(request_id=rid)
    if kind == "refuse":
        return protocol.Refuse(code="c", message=draw(st.text(max_size=50)), request_id=rid)
    return protocol.WriteDone(request_id=rid)


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` truncated, with bytes flipped, inserted or deleted."""
    how = draw(st.sampled_from(["truncate", "flip", "insert", "delete", "splice"]))
    b = bytearray(data)
    if how == "truncate":
        return bytes(b[: draw(st.integers(0, max(0, len(b) - 1)))])
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(b) - 1))
            b[i] = draw(st.integers(0, 255))
        return bytes(b)
    i = draw(st.integers(0, len(b)))
    if how == "insert":
        return bytes(b[:i] + draw(st.binary(min_size=1, max_size=16)) + b[i:])
    if how == "delete":
        return bytes(b[:i] + b[i + draw(st.integers(1, 16)) :])
    return bytes(b[:i] + draw(st.binary(max_size=16)) + b[i + draw(st.integers(0, 16)) :])


# ------------------------------------------------------- attacks on the reader
def test_random_bytes(reader: HiddenStatesReader) -> None:
    @settings(max_examples=40, deadline=None)
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
    @settings(max_examples=40, deadline=None)
    @given(state=st.sampled_from(STATES), payload=msgpack_payloads)
    def run(state: str, payload: bytes) -> None:
        attack(reader, state, frame(payload), model(state, payload))

    run()
    deliver_honestly(reader)


def test_truncated_and_corrupted_real_messages(reader: HiddenStatesReader) -> None:
    @settings(max_examples=40, deadline=None)
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
    @settings(max_examples=20, deadline=None)
    @given(
        state=st.sampled_from(STATES),
        n=st.integers(protocol.MAX_FRAME_BYTES + 1, 2**32 - 1),
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


@st.composite
def hostile_credit_requests(draw: st.DrawFn) -> bytes:
    """Credit requests with out-of-range fields, and producer-side messages that only a
    reader may send."""
    rid = draw(rids)
    n = draw(st.sampled_from([1, 15, 16, 17, 200, 767, 768, 769, 1 << 17]))
    bs = draw(st.sampled_from([1, LAYOUT.block_size, 1 << 16]))
    m = manifest(rid, n, bs)
    nb = m.num_blocks
    blocks = list(range(nb))
    what = draw(
        st.sampled_from(
            [
                "valid",
                "block_beyond",
                "block_huge",
                "duplicate_block",
                "missing_block",
                "num_blocks",
                "block_bytes",
                "dtype",
                "layout",
                "hidden_size",
                "token_id",
                "too_many_tokens",
                "layer_id",
                "grant",
                "write_done",
                "ack",
                "hello",
            ]
        )
    )
    if what == "block_beyond":
        blocks.append(nb + draw(st.integers(0, 1 << 20)))
    elif what == "block_huge":
        blocks = [draw(st.integers(protocol.MAX_BLOCKS, 2**64 - 1))]
    elif what == "duplicate_block":
        blocks.append(draw(st.sampled_from(blocks)))
    elif what == "missing_block":
        blocks.remove(draw(st.sampled_from(blocks)))
    elif what == "num_blocks":
        m = msgspec.structs.replace(m, num_blocks=nb + draw(st.sampled_from([-1, 1, 1 << 21])) or 1)
    elif what == "block_bytes":
        m = msgspec.structs.replace(m, block_bytes=m.block_bytes + draw(st.sampled_from([-4, 1, 1 << 40])))
    elif what == "dtype":
        m = msgspec.structs.replace(m, dtype=draw(st.sampled_from(["float64", "int8", "", "torch.float32"])))
    elif what == "layout":
        m = msgspec.structs.replace(m, layout=draw(st.sampled_from(["HTL", "lth", ""])))
    elif what == "hidden_size":
        h = draw(st.sampled_from([0, -1, (1 << 20) + 1, 1 << 20]))
        m = msgspec.structs.replace(m, hidden_size=h, block_bytes=bs * len(LAYER_IDS) * h * 4)
    elif what == "token_id":
        m = msgspec.structs.replace(
            m, token_ids=[*m.token_ids[:-1], draw(st.sampled_from([-1, 1 << 40, 2**64 - 1]))]
        )
    elif what == "too_many_tokens":
        big = protocol.MAX_TOKENS + 1
        m = msgspec.structs.replace(
            m, token_ids=[1] * big, block_size=1 << 16, num_blocks=-(-big // (1 << 16))
        )
        blocks = list(range(m.num_blocks))
    elif what == "layer_id":
        m = msgspec.structs.replace(m, layer_ids=[*LAYER_IDS[:-1], draw(st.sampled_from([-2, 1 << 16]))])
    if what == "grant":
        pages = draw(st.lists(st.integers(0, protocol.MAX_PAGES - 1), min_size=1, max_size=8))
        return protocol.encode(protocol.Grant(request_id=rid, pages=pages, pages_per_block=1))
    if what == "write_done":
        return protocol.encode(protocol.WriteDone(request_id=rid))
    if what == "ack":
        return protocol.encode(protocol.Ack(request_id=rid))
    if what == "hello":
        return protocol.encode(
            protocol.Hello(
                version=protocol.PROTOCOL_VERSION,
                producer_id=uid("again"),
                rank=0,
                world_size=1,
                agent_name="a",
                block_bytes=PAGE,
                nonce=bytes(32),
            )
        )
    return protocol.encode(protocol.CreditRequest(manifest=m, blocks=blocks))


def test_out_of_range_fields_from_an_authenticated_producer(reader: HiddenStatesReader) -> None:
    @settings(max_examples=40, deadline=None)
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

        @settings(max_examples=20, deadline=None)
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
        got = reader.get(timeout=20)
        assert got.request_id == rid and got.producer_id == victim_id
        assert same_bytes(got.hidden_states, expected_states(CACHE, LAYOUT, [4, 8, 15], 40))
        assert not victim.take_failed()
    finally:
        victim.close()
    deliver_honestly(reader)


def test_replaying_a_connected_producers_agent_metadata_is_refused(reader: HiddenStatesReader) -> None:
    victim = HiddenStatesSender(
        SenderConfig(reader.address, uid("victim"), connect_timeout_s=10), CACHE, LAYOUT, LAYER_IDS
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
            digest = auth.proof(None, "producer", pid, 0, nonce, ch.nonce)
            conn.send(protocol.Auth(digest=digest, agent_metadata=victim._transport.metadata))
            msg = conn.receive_one(5)
            assert isinstance(msg, protocol.Refuse) and "in use" in msg.message, msg
        finally:
            conn.close()
        rid = uid("after-replay")
        victim.ship(rid, token_ids(rid, 33), [1, 2, 3])
        got = reader.get(timeout=20)
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
            conn.send(protocol.Auth(digest=bytes(32), agent_metadata=b"not NIXL metadata"))
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
                    got = reader.get(timeout=0.1)
            assert same_bytes(got.hidden_states, expected_states(CACHE, LAYOUT, [3, 4, 5], 40))
        finally:
            sender.close()


@pytest.mark.parametrize("sent", ["nothing", "hello"])
def test_a_connection_that_never_finishes_its_handshake_is_closed(
    sent: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader_core, "HANDSHAKE_TIMEOUT_S", 1.0)
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


# --------------------------------------------------- a hostile "reader"
@pytest.fixture(scope="module")
def fake_agent() -> Iterator[tuple[Transport, Any]]:
    """A real NIXL agent for the fake reader, with a small registered pool."""
    t = Transport(uid("fake-agent"))
    mem = torch.zeros(4 * PAGE, dtype=torch.uint8)
    region = t.register(mem)
    try:
        yield t, region
    finally:
        t.close()


class FakeReader:
    """A plain TCP server speaking our framing; ``respond(fake, conn, hello)`` scripts what
    each connection gets after the producer's Hello (the connection closes after it)."""

    def __init__(
        self,
        respond: Callable[[FakeReader, FramedConnection, protocol.Message], None],
        agent: tuple[Transport, Any] | None = None,
    ) -> None:
        self.respond = respond
        self.agent = agent  # (NIXL agent, its registered region) for a Welcome
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(0.05)
        self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.received: list[str] = []
        self.connections = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def recv(self, conn: FramedConnection, timeout: float = 5.0) -> protocol.Message:
        msg = conn.receive_one(timeout)
        self.received.append(type(msg).__name__)
        return msg

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn = FramedConnection(sock, send_timeout=5)
            try:
                self.respond(self, conn, self.recv(conn))
            except Exception as e:  # the sender may leave at any point
                self.errors.append(e)
            finally:
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.srv.close()


def challenge_for(hello: protocol.Message, secret: bytes | None = None, **kw: Any) -> protocol.Challenge:
    assert isinstance(hello, protocol.Hello)
    rn = auth.make_nonce()
    fields: dict[str, Any] = dict(
        version=protocol.PROTOCOL_VERSION,
        nonce=rn,
        digest=auth.proof(secret, "reader", hello.producer_id, hello.rank, hello.nonce, rn),
        auth_required=secret is not None,
    )
    fields.update(kw)
    return protocol.Challenge(**fields)


def welcome_for(agent: Transport, region: Any, **kw: Any) -> protocol.Welcome:
    fields: dict[str, Any] = dict(
        reader_id="fake",
        agent_name=agent.name,
        agent_metadata=agent.metadata,
        pool_addr=region.addr,
        pool_bytes=region.nbytes,
        page_bytes=PAGE,
        num_pages=4,
        mem_type="DRAM",
        device_id=0,
    )
    fields.update(kw)
    return protocol.Welcome(**fields)


SENDER_BOUND_S = 5.0  # connect_timeout_s is 0.5 s: a request must fail well within this


def ship_to_fake(fake: FakeReader, secret: bytes | None = None) -> str:
    """A real sender ships one request to ``fake``; it must fail in bounded time with a
    reason, and the sender must close promptly. Returns the reason."""
    sender = HiddenStatesSender(
        SenderConfig(fake.address, uid("victim"), connect_timeout_s=0.5),
        CACHE,
        LAYOUT,
        LAYER_IDS,
        secret=secret,
    )
    try:
        sender.ship("victim-r", token_ids("victim-r", 40), [3, 5, 7])
        deadline = time.monotonic() + SENDER_BOUND_S
        failed: dict[str, str] = {}
        while not failed:
            assert not sender.take_finished(), "a fake reader's request was reported delivered"
            assert time.monotonic() < deadline, (
                f"the sender neither failed nor finished its request in {SENDER_BOUND_S:.0f} s "
                f"({fake.connections} connections to the fake reader)"
            )
            time.sleep(0.02)
            failed = sender.take_failed()
        assert set(failed) == {"victim-r"}
        assert sender.in_flight == 0
    finally:
        t0 = time.monotonic()
        sender.close()
        closing = time.monotonic() - t0
    assert closing < 5, f"closing the sender took {closing:.1f} s"
    reason = failed["victim-r"]
    assert reason and ("reader" in reason or "WRITE" in reason), reason
    return reason


def send_raw(data: bytes) -> Callable[[FakeReader, FramedConnection], None]:
    return lambda fake, conn: conn.sock.sendall(data)


fake_replies = st.one_of(
    st.binary(min_size=1, max_size=256).map(send_raw),
    msgpack_payloads.map(frame).map(send_raw),
    real_messages().flatmap(lambda m: mutated(protocol.encode(m))).map(frame).map(send_raw),
    real_messages().map(lambda m: send_raw(frame(protocol.encode(m)))),
)


def test_a_reader_answering_the_handshake_with_garbage_fails_the_request() -> None:
    @settings(max_examples=10, deadline=None)
    @given(stage=st.sampled_from(["challenge", "welcome"]), reply=fake_replies)
    def run(stage: str, reply: Callable[[FakeReader, FramedConnection], None]) -> None:
        def respond(fake: FakeReader, conn: FramedConnection, hello: protocol.Message) -> None:
            if stage == "welcome":
                conn.send(challenge_for(hello))
                assert isinstance(fake.recv(conn), protocol.Auth)
            reply(fake, conn)

        fake = FakeReader(respond)
        try:
            ship_to_fake(fake)
        finally:
            fake.close()

    run()


SPECIFIC_HANDSHAKES: dict[str, tuple[bytes | None, str, Callable[..., None]]] = {
    # name: (the sender's secret, a phrase its reason must hold, respond)
    "wrong-version": (
        None,
        "protocol version",
        lambda f, c, h: c.send(challenge_for(h, version=protocol.PROTOCOL_VERSION + 1)),
    ),
    "secret-required": (None, auth.SECRET_ENV, lambda f, c, h: c.send(challenge_for(h, b"theirs"))),
    "reader-without-the-secret": (
        b"ours",
        "reader failed authentication",
        lambda f, c, h: c.send(challenge_for(h)),
    ),
    "reader-with-another-secret": (
        b"ours",
        "reader failed authentication",
        lambda f, c, h: c.send(challenge_for(h, b"theirs")),
    ),
    "refused": (None, "go away", lambda f, c, h: c.send(protocol.Refuse(code="nope", message="go away"))),
    "welcome-first": (None, "expected a challenge", lambda f, c, h: c.send(welcome_for(*f.agent))),
    "oversize-frame": (
        None,
        "exceeds",
        lambda f, c, h: c.sock.sendall(_LEN.pack(protocol.MAX_FRAME_BYTES + 1)),
    ),
    "closed": (None, "closed", lambda f, c, h: None),
}


@pytest.mark.parametrize("name", list(SPECIFIC_HANDSHAKES))
def test_a_reader_failing_the_handshake_gets_a_clear_reason(
    name: str, fake_agent: tuple[Transport, Any]
) -> None:
    secret, phrase, respond = SPECIFIC_HANDSHAKES[name]
    fake = FakeReader(respond, fake_agent)
    try:
        reason = ship_to_fake(fake, secret)
    finally:
        fake.close()
    assert phrase in reason, reason
    # No Auth (the producer's proof and NIXL metadata) ever reached this reader.
    assert "Auth" not in fake.received and "Hello" in fake.received


SPECIFIC_WELCOMES: dict[str, tuple[str, Callable[..., protocol._Msg]]] = {
    "garbage-metadata": ("metadata", lambda a, r: welcome_for(a, r, agent_metadata=b"\x00garbage")),
    "truncated-metadata": ("metadata", lambda a, r: welcome_for(a, r, agent_metadata=a.metadata[:40])),
    "challenge-again": ("expected welcome", lambda a, r: challenge_for_any()),
    "refused": ("no room", lambda a, r: protocol.Refuse(code="full", message="no room")),
}


def challenge_for_any() -> protocol.Challenge:
    return protocol.Challenge(
        version=protocol.PROTOCOL_VERSION, nonce=bytes(32), digest=bytes(32), auth_required=False
    )


@pytest.mark.parametrize("name", list(SPECIFIC_WELCOMES))
def test_a_reader_sending_an_invalid_welcome_gets_a_clear_reason(
    name: str, fake_agent: tuple[Transport, Any]
) -> None:
    agent, region = fake_agent
    phrase, make = SPECIFIC_WELCOMES[name]

    def respond(fake: FakeReader, conn: FramedConnection, hello: protocol.Message) -> None:
        conn.send(challenge_for(hello))
        assert isinstance(fake.recv(conn), protocol.Auth)
        conn.send(make(agent, region))

    fake = FakeReader(respond)
    try:
        reason = ship_to_fake(fake)
    finally:
        fake.close()
    assert phrase in reason, reason


def _grant_stage(make: Callable[[protocol.CreditRequest], bytes]) -> Callable[..., None]:
    def respond(fake: FakeReader, conn: FramedConnection, hello: protocol.Message) -> None:
        conn.send(challenge_for(hello))
        assert isinstance(fake.recv(conn), protocol.Auth)
        assert fake.agent is not None
        agent, region = fake.agent
        conn.send(welcome_for(agent, region))
        req = fake.recv(conn)
        assert isinstance(req, protocol.CreditRequest)
        conn.sock.sendall(make(req))
        time.sleep(0.2)

    return respond


def _grant(req: protocol.CreditRequest, pages: list[int], ppb: int = 1, rid: str | None = None) -> bytes:
    g = protocol.Grant(request_id=rid or req.manifest.request_id, pages=pages, pages_per_block=ppb)
    return frame(protocol.encode(g))


SPECIFIC_GRANTS = [
    pytest.param(
        "pages-outside-the-pool", "outside the reader's pool", lambda r: _grant(r, [10_000, 10_001, 10_002])
    ),
    pytest.param(
        "refused-request",
        "too big",
        lambda r: frame(protocol.encode(protocol.Refuse(code="x", message="too big", request_id="victim-r"))),
    ),
    pytest.param("garbage", "reader", lambda r: frame(b"\xc1garbage")),
    pytest.param("too-few-pages", "does not fit", lambda r: _grant(r, [0])),
    pytest.param("unknown-request", "not waiting", lambda r: _grant(r, [0, 1, 2], rid="other")),
    pytest.param(
        "rewrite-before-any-grant",
        "not granted",
        lambda r: frame(protocol.encode(protocol.Rewrite(request_id=r.manifest.request_id, reason="x"))),
    ),
]


@pytest.mark.parametrize("name, phrase, make", SPECIFIC_GRANTS, ids=[p.values[0] for p in SPECIFIC_GRANTS])
def test_a_reader_answering_a_credit_request_with_garbage_fails_the_request(
    name: str, phrase: str, make: Callable[[protocol.CreditRequest], bytes], fake_agent: tuple[Transport, Any]
) -> None:
    fake = FakeReader(_grant_stage(make), fake_agent)
    try:
        reason = ship_to_fake(fake)
    finally:
        fake.close()
    assert phrase in reason, reason


def test_a_trickling_reader_cannot_hold_the_sender_forever() -> None:
    stop = threading.Event()

    def respond(fake: FakeReader, conn: FramedConnection, hello: protocol.Message) -> None:
        conn.sock.sendall(_LEN.pack(1000))  # a frame that never completes
        while not stop.wait(0.5):
            conn.sock.sendall(b"\x00")

    fake = FakeReader(respond)
    try:
        bound = 10.0 + 0.5 + 2.0  # one handshake wait (10 s) past connect_timeout_s, and slack
        sender = HiddenStatesSender(
            SenderConfig(fake.address, uid("victim"), connect_timeout_s=0.5), CACHE, LAYOUT, LAYER_IDS
        )
        try:
            sender.ship("victim-r", token_ids("victim-r", 40), [3, 5, 7])
            deadline = time.monotonic() + bound
            failed: dict[str, str] = {}
            while not failed and time.monotonic() < deadline:
                time.sleep(0.05)
                failed = sender.take_failed()
            assert "victim-r" in failed, f"no failure after {bound:.0f} s: the handshake hangs"
        finally:
            stop.set()
            sender.close()
    finally:
        stop.set()
        fake.close()
