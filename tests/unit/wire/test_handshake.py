"""Both ends of the handshake: the reader's side as a state machine (every transition,
every illegal one, the frame limit of each phase, the deadline), and the producer's side
over an in-process socket pair against a scripted reader (checks the reader's proof
before it sends its own metadata; clear reasons for every refusal)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import msgspec
import pytest

from kv_connector.wire import auth, fields, handshake, protocol
from kv_connector.wire.control import FramedConnection
from kv_connector.wire.handshake import FRAME_LIMITS, HandshakeError, Phase, ProducerIdentity, ReaderHandshake
from kv_connector.wire.protocol import ProtocolError

ME = ProducerIdentity("prod", 1, 2, "prod-r1", 4096)


def hello(nonce: bytes = b"p" * 32, **kw: object) -> protocol.Hello:
    fields: dict[str, object] = dict(
        version=protocol.PROTOCOL_VERSION,
        producer_id=ME.producer_id,
        rank=ME.rank,
        world_size=ME.world_size,
        agent_name=ME.agent_name,
        block_bytes=ME.block_bytes,
        nonce=nonce,
    )
    fields.update(kw)
    return protocol.Hello(**fields)  # type: ignore[arg-type]


def welcome() -> protocol.Welcome:
    return protocol.Welcome(
        reader_id="r", agent_name="ra", agent_metadata=b"reader-md", pool_addr=0, pool_bytes=4096,
        page_bytes=4096, num_pages=1, mem_type="DRAM", device_id=0, proof=bytes(32),
    )  # fmt: skip


# ------------------------------------------------------------ reader's side
@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_the_reader_goes_hello_auth_ready(secret: bytes | None) -> None:
    hs = ReaderHandshake(secret, t_accept=0.0)
    assert hs.phase is Phase.HELLO and hs.frame_limit == FRAME_LIMITS[Phase.HELLO]
    ch = hs.on_hello(hello(), known_world=None, rank_taken=False)
    assert hs.phase is Phase.AUTH and hs.frame_limit == FRAME_LIMITS[Phase.AUTH]
    assert ch.auth_required == (secret is not None) and ch.nonce == hs.nonce
    assert auth.verify(auth.proof(secret, "reader", "prod", 1, b"p" * 32, hs.nonce), ch.proof)
    proof = auth.proof(secret, "producer", "prod", 1, b"p" * 32, hs.nonce, auth.digest_of(b"md"))
    hs.on_auth(protocol.Auth(proof=proof, agent_metadata=b"md"))
    sealed = hs.welcome(welcome())
    assert hs.phase is Phase.READY and hs.frame_limit == fields.MAX_FRAME_BYTES
    assert not hs.expired(1e9)
    # the Welcome carries the reader's proof over every one of its fields
    want = handshake.welcome_proof(secret, "prod", 1, b"p" * 32, hs.nonce, sealed)
    assert sealed.proof == want and sealed.binding() == welcome().binding()
    assert (hs.session() is None) == (secret is None)


def test_the_producers_proof_binds_its_metadata() -> None:
    """A relay that swaps in its own NIXL metadata (to get keys to the producer's cache,
    or to make the reader load its agent) breaks the proof."""
    hs = ReaderHandshake(b"ours", t_accept=0.0)
    hs.on_hello(hello(), None, False)
    proof = auth.proof(b"ours", "producer", "prod", 1, b"p" * 32, hs.nonce, auth.digest_of(b"md"))
    with pytest.raises(ProtocolError, match="metadata altered"):
        hs.on_auth(protocol.Auth(proof=proof, agent_metadata=b"relay-md"))
    hs.on_auth(protocol.Auth(proof=proof, agent_metadata=b"md"))  # the real one passes


def test_a_wrong_proof_is_refused() -> None:
    hs = ReaderHandshake(b"ours", t_accept=0.0)
    hs.on_hello(hello(), None, False)
    bad = auth.proof(b"theirs", "producer", "prod", 1, b"p" * 32, hs.nonce, auth.digest_of(b"md"))
    with pytest.raises(ProtocolError, match="authentication failed"):
        hs.on_auth(protocol.Auth(proof=bad, agent_metadata=b"md"))
    unbound = auth.proof(b"ours", "producer", "prod", 1, b"p" * 32, hs.nonce)  # the v1 proof
    with pytest.raises(ProtocolError, match="authentication failed"):
        hs.on_auth(protocol.Auth(proof=unbound, agent_metadata=b"md"))
    reflected = auth.proof(b"ours", "reader", "prod", 1, b"p" * 32, hs.nonce)  # its own proof back
    with pytest.raises(ProtocolError, match="authentication failed"):
        hs.on_auth(protocol.Auth(proof=reflected, agent_metadata=b"md"))


@pytest.mark.parametrize(
    "msg, known, taken, match",
    [
        (protocol.Auth(proof=bytes(32), agent_metadata=b""), None, False, "expected hello, got Auth"),
        (hello(), 4, False, "world size 4 before, now 2"),
        (hello(rank=2), None, False, "outside world size"),
        (hello(), None, True, "already connected"),
    ],
)
def test_a_bad_hello_is_refused(msg: protocol.Message, known: int | None, taken: bool, match: str) -> None:
    hs = ReaderHandshake(None, t_accept=0.0)
    with pytest.raises(ProtocolError, match=match):
        hs.on_hello(msg, known, taken)
    assert hs.phase is Phase.HELLO


def test_transitions_outside_their_phase_are_refused() -> None:
    hs = ReaderHandshake(None, t_accept=0.0)
    with pytest.raises(ProtocolError, match="an auth in phase hello"):
        hs.on_auth(protocol.Auth(proof=bytes(32), agent_metadata=b""))
    with pytest.raises(ProtocolError, match="a welcome in phase hello"):
        hs.welcome(welcome())
    hs.on_hello(hello(), None, False)
    with pytest.raises(ProtocolError, match="a hello in phase auth"):
        hs.on_hello(hello(), None, False)
    hs.welcome(welcome())
    with pytest.raises(ProtocolError, match="a welcome in phase ready"):
        hs.welcome(welcome())
    with pytest.raises(ProtocolError, match="an auth in phase ready"):
        hs.on_auth(protocol.Auth(proof=bytes(32), agent_metadata=b""))


def test_a_handshake_not_done_in_time_has_expired(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT_S", 2.0)
    hs = ReaderHandshake(None, t_accept=10.0)
    assert not hs.expired(11.9) and hs.expired(12.1)
    hs.on_hello(hello(), None, False)
    assert hs.expired(12.1)


def test_before_proving_anything_a_peer_may_send_no_more_than_a_hello() -> None:
    assert len(protocol.encode(hello())) < FRAME_LIMITS[Phase.HELLO] < FRAME_LIMITS[Phase.AUTH]
    a, b = socket.socketpair()
    try:
        conn = FramedConnection(a)
        conn.max_frame = FRAME_LIMITS[Phase.HELLO]
        b.sendall((FRAME_LIMITS[Phase.HELLO] + 1).to_bytes(4, "big"))
        conn.fill()
        with pytest.raises(ProtocolError, match="exceeds"):
            conn.receive_buffered()
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------ producer's side
Script = Callable[[FramedConnection, protocol.Hello], None]


@pytest.fixture
def pair() -> Iterator[tuple[FramedConnection, FramedConnection]]:
    a, b = socket.socketpair()
    ca, cb = FramedConnection(a, send_timeout=5), FramedConnection(b, send_timeout=5)
    yield ca, cb
    ca.close()
    cb.close()


def run_producer(
    pair: tuple[FramedConnection, FramedConnection], script: Script, secret: bytes | None
) -> tuple[protocol.Welcome | Exception, list[str]]:
    producer, reader = pair
    seen: list[str] = []

    def serve() -> None:
        try:
            h = reader.receive_one(5)
            seen.append(type(h).__name__)
            assert isinstance(h, protocol.Hello)
            script(reader, h)
        except Exception as e:
            seen.append(f"error: {e}")

    t = threading.Thread(target=serve)
    t.start()
    try:
        result: protocol.Welcome | Exception = handshake.as_producer(producer, ME, secret, b"producer-md", 5)
    except (HandshakeError, ProtocolError, TimeoutError, OSError) as e:
        result = e
    t.join(5)
    return result, seen


def honest(secret: bytes | None, alter: dict[str, object] | None = None) -> Script:
    """A reader that follows the protocol; ``alter``: fields a relay changes in its
    Welcome after the reader sealed it."""

    def script(conn: FramedConnection, h: protocol.Hello) -> None:
        hs = ReaderHandshake(secret, 0.0)
        conn.send(hs.on_hello(h, None, False))
        a = conn.receive_one(5)
        assert isinstance(a, protocol.Auth) and a.agent_metadata == b"producer-md"
        hs.on_auth(a)
        sealed = hs.welcome(welcome())
        conn.send(msgspec.structs.replace(sealed, **(alter or {})))
        conn.mac = hs.session()

    return script


@pytest.mark.parametrize("secret", [None, b"shared"])
def test_the_producer_completes_the_handshake_with_an_honest_reader(
    pair: tuple[FramedConnection, FramedConnection], secret: bytes | None
) -> None:
    result, seen = run_producer(pair, honest(secret), secret)
    assert isinstance(result, protocol.Welcome) and result.binding() == welcome().binding()
    assert seen == ["Hello"]
    assert pair[0].max_frame == fields.MAX_FRAME_BYTES
    assert (pair[0].mac is None) == (secret is None)


@pytest.mark.parametrize(
    "alter", [{"pool_addr": 1 << 30}, {"agent_metadata": b"relay-md"}, {"page_bytes": 2048}]
)
def test_the_producer_refuses_a_welcome_altered_on_the_way(
    pair: tuple[FramedConnection, FramedConnection], alter: dict[str, object]
) -> None:
    result, _ = run_producer(pair, honest(b"shared", alter), b"shared")
    assert isinstance(result, HandshakeError) and "Welcome failed authentication" in str(result)


def test_after_the_handshake_every_message_is_tagged_in_order(
    pair: tuple[FramedConnection, FramedConnection],
) -> None:
    """Forged, replayed or reordered control messages (an Ack for a sample not sent, a
    Rewrite...) are refused once a secret set up the session."""
    producer, reader = pair
    result, _ = run_producer(pair, honest(b"shared"), b"shared")
    assert isinstance(result, protocol.Welcome) and producer.mac is not None and reader.mac is not None
    producer.send(protocol.Ack(request_id="a"))
    producer.send(protocol.Ack(request_id="b"))
    assert reader.receive_one(5) == protocol.Ack(request_id="a")
    assert reader.receive_one(5) == protocol.Ack(request_id="b")
    reader.send(protocol.Ack(request_id="from-reader"))
    assert producer.receive_one(5) == protocol.Ack(request_id="from-reader")
    # a frame injected without the session key (a replay of the first one, here)
    replay = protocol.encode(protocol.Ack(request_id="a"))
    producer.sock.sendall(len(replay).to_bytes(4, "big") + replay)
    with pytest.raises(ProtocolError, match="integrity"):
        reader.receive_one(5)


def challenge(h: protocol.Hello, secret: bytes | None, **kw: object) -> protocol.Challenge:
    fields: dict[str, object] = dict(
        version=protocol.PROTOCOL_VERSION,
        nonce=b"r" * 32,
        proof=auth.proof(secret, "reader", h.producer_id, h.rank, h.nonce, b"r" * 32),
        auth_required=secret is not None,
    )
    fields.update(kw)
    return protocol.Challenge(**fields)  # type: ignore[arg-type]


CASES: dict[str, tuple[bytes | None, Script, str]] = {
    "refused": (None, lambda c, h: c.send(protocol.Refuse(code="protocol", message="go away")), "go away"),
    "welcome-first": (None, lambda c, h: c.send(welcome()), "expected a challenge"),
    "secret-required": (None, lambda c, h: c.send(challenge(h, b"theirs")), "KV_CONNECTOR_SECRET"),
    "reader-without-secret": (
        b"ours",
        lambda c, h: c.send(challenge(h, None)),
        "reader failed authentication",
    ),
    "reader-other-secret": (
        b"ours",
        lambda c, h: c.send(challenge(h, b"theirs")),
        "reader failed authentication",
    ),
    "wrong-version": (
        None,
        lambda c, h: c.send(challenge(h, None, version=protocol.PROTOCOL_VERSION + 1)),
        "protocol version",
    ),
    "huge-challenge": (
        None,
        lambda c, h: c.sock.sendall((handshake.CHALLENGE_LIMIT + 1).to_bytes(4, "big")),
        "exceeds",
    ),
    "silent": (None, lambda c, h: None, "no complete message"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_producer_refuses_a_bad_reader_before_sending_its_metadata(
    pair: tuple[FramedConnection, FramedConnection], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret, script, phrase = CASES[name]
    if name == "silent":
        pair[0].sock.settimeout(5)
        result, seen = None, []
        producer, _ = pair
        with pytest.raises(TimeoutError, match=phrase):
            handshake.as_producer(producer, ME, secret, b"producer-md", 0.3)
        return
    result, seen = run_producer(pair, script, secret)
    assert isinstance(result, Exception) and phrase in str(result), result
    assert "Auth" not in seen  # its proof and its metadata never left


def test_the_producer_reads_a_refusal_after_its_auth(pair: tuple[FramedConnection, FramedConnection]) -> None:
    def script(conn: FramedConnection, h: protocol.Hello) -> None:
        conn.send(challenge(h, None))
        assert isinstance(conn.receive_one(5), protocol.Auth)
        conn.send(protocol.Refuse(code="protocol", message="agent name does not match"))

    result, _ = run_producer(pair, script, None)
    assert isinstance(result, HandshakeError) and "agent name does not match" in str(result)
