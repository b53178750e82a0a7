"""A hostile "reader" against a real sender: a plain TCP server speaking our framing
answers a real ``HiddenStatesSender`` (real NIXL agent) with garbage, or with invalid
handshake, welcome and credit messages. The sender must fail its request with a clear
reason, in bounded time, without crashing. The sender's job states and the producer's
side of the handshake are proven case by case in ``tests/unit`` (test_send_ledger,
test_handshake); these keep the real path honest.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
from kv_connector.wire import auth, fields, protocol
from kv_connector.wire.control import FramedConnection
from kv_connector.wire.nixl_transport import NixlTransport as Transport
from tests.integration.common import token_ids
from tests.integration.hostile_common import (
    _LEN,
    CACHE,
    LAYER_IDS,
    LAYOUT,
    PAGE,
    FakeReader,
    challenge_for,
    frame,
    msgpack_payloads,
    mutated,
    real_messages,
    send_raw,
    ship_to_fake,
    uid,
    welcome_for,
)

pytestmark = pytest.mark.integration


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


fake_replies = st.one_of(
    st.binary(min_size=1, max_size=256).map(send_raw),
    msgpack_payloads.map(frame).map(send_raw),
    real_messages().flatmap(lambda m: mutated(protocol.encode(m))).map(frame).map(send_raw),
    real_messages().map(lambda m: send_raw(frame(protocol.encode(m)))),
)


def test_a_reader_answering_the_handshake_with_garbage_fails_the_request() -> None:
    @settings(max_examples=6, deadline=None)
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
    "secret-required": (None, auth.SECRET_ENV, lambda f, c, h: c.send(challenge_for(h, b"theirs"))),
    "refused": (None, "go away", lambda f, c, h: c.send(protocol.Refuse(code="protocol", message="go away"))),
    "oversize-frame": (
        None,
        "exceeds",
        lambda f, c, h: c.sock.sendall(_LEN.pack(fields.MAX_FRAME_BYTES + 1)),
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
    "refused": ("no room", lambda a, r: protocol.Refuse(code="pool_too_small", message="no room")),
}


def challenge_for_any() -> protocol.Challenge:
    return protocol.Challenge(
        version=protocol.PROTOCOL_VERSION, nonce=bytes(32), proof=bytes(32), auth_required=False
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


def _grant(req: protocol.CreditRequest, first: int, n: int, rid: str | None = None) -> bytes:
    g = protocol.Grant(request_id=rid or req.manifest.request_id, first_page=first, num_pages=n, generation=1)
    return frame(protocol.encode(g))


SPECIFIC_GRANTS = [
    pytest.param("pages-outside-the-pool", "outside the reader's pool", lambda r: _grant(r, 10_000, 3)),
    pytest.param(
        "refused-request",
        "too big",
        lambda r: frame(
            protocol.encode(protocol.Refuse(code="pool_too_small", message="too big", request_id="victim-r"))
        ),
    ),
    pytest.param("garbage", "reader", lambda r: frame(b"\xc1garbage")),
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
