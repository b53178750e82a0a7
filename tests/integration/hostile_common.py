"""Shared by the hostile-peer suites: raw framing, sessions brought to a handshake phase,
the model of the reader's answers, strategies for malformed input, and a scripted fake
reader. Not a test module."""

from __future__ import annotations

import itertools
import math
import os
import random
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import strategies as st

from kv_connector.reader import HiddenStatesReader
from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
from kv_connector.wire import auth, handshake, protocol
from kv_connector.wire.control import FramedConnection, parse_address
from kv_connector.wire.failure import SampleFailure
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.nixl_transport import NixlTransport as Transport
from kv_connector.wire.protocol import ProtocolError
from tests.integration.common import expected_states, make_cache, same_bytes, token_ids

LAYOUT = BlockLayout("LTH", 16, 3, 64, "float32")
PAGE = LAYOUT.block_bytes
NUM_PAGES = 48
NUM_CACHE_BLOCKS = 64
LAYER_IDS = list(range(LAYOUT.num_layers))
STATES = ("fresh", "hello", "ready")
FRAME_LIMIT = {
    "fresh": handshake.FRAME_LIMITS[handshake.Phase.HELLO],
    "hello": handshake.FRAME_LIMITS[handshake.Phase.AUTH],
    "ready": handshake.FRAME_LIMITS[handshake.Phase.READY],
}
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
                proof = auth.proof(None, "producer", self.pid, 0, self.nonce, self.challenge.nonce)
                self.conn.send(protocol.Auth(proof=proof, agent_metadata=self.transport.metadata))
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
    """The serving thread runs: a new connection's Hello gets its Challenge."""
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
            got = reader.get(timeout=30, copy=True)  # the next sample needs these pages
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
    if n is not None and n > FRAME_LIMIT[state]:  # each handshake phase bounds its frames
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
    pages = math.ceil(m.geometry.sample_bytes(m.num_blocks) / PAGE)
    if pages > NUM_PAGES:
        return Expect("pool_too_small", {"request_id": m.request_id})
    if set(msg.blocks) != set(range(m.num_blocks)):
        return Expect("refuse", {"match": "unwritten"})
    return Expect("grant", {"request_id": m.request_id, "pages": pages})


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
        # granted, or waiting for pages that earlier examples' discarded samples hold in
        # quarantine (the pool's exact accounting is proven in tests/unit/reader/push/test_ledger)
        if not got:
            return
        assert len(got) == 1 and isinstance(got[0], protocol.Grant), got
        g = got[0]
        assert g.request_id == expect.detail["request_id"]
        assert g.num_pages == expect.detail["pages"] and g.first_page + g.num_pages <= NUM_PAGES
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
TAGS += ["fenced"]
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


def manifest(rid: str, n: int, bs: int = LAYOUT.block_size) -> protocol.Manifest:
    g = msgspec.structs.replace(LAYOUT, block_size=bs)
    return protocol.Manifest(
        request_id=rid,
        token_ids=token_ids(rid, n),
        layer_ids=LAYER_IDS,
        geometry=g,
        num_blocks=g.blocks_for(n),
    )


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
            version=protocol.PROTOCOL_VERSION, nonce=draw(nonces), proof=draw(nonces), auth_required=False
        )
    if kind == "auth":
        return protocol.Auth(proof=draw(nonces), agent_metadata=draw(st.binary(max_size=200)))
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
            proof=draw(nonces),
        )
    if kind == "credit_request":
        n = draw(st.integers(1, 6 * LAYOUT.block_size))
        return protocol.CreditRequest(
            manifest=manifest(rid, n), blocks=list(range(-(-n // LAYOUT.block_size)))
        )
    if kind == "grant":
        return protocol.Grant(
            request_id=rid, first_page=draw(st.integers(0, 99)), num_pages=draw(st.integers(1, 99)),
            generation=draw(st.integers(1, (1 << 63) - 1)),
        )  # fmt: skip
    if kind == "ack":
        return protocol.Ack(request_id=rid)
    if kind == "refuse":
        return protocol.Refuse(code="protocol", message=draw(st.text(max_size=50)), request_id=rid)
    if kind == "fenced":
        return protocol.Fenced(request_id=rid, generation=draw(st.integers(1, (1 << 63) - 1)))
    return protocol.WriteDone(request_id=rid, generation=draw(st.integers(1, (1 << 63) - 1)))


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
        proof=auth.proof(secret, "reader", hello.producer_id, hello.rank, hello.nonce, rn),
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
        proof=bytes(32),  # unchecked without a secret
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
        failed: dict[str, SampleFailure] = {}
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
    reason = failed["victim-r"].why
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
