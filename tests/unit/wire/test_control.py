"""Control framing, addresses and the handshake's HMAC."""

from __future__ import annotations

import socket
import struct

import pytest

from kv_connector.wire import auth, fields, protocol
from kv_connector.wire.control import ConnectionClosed, FramedConnection, parse_address
from kv_connector.wire.protocol import ProtocolError


@pytest.mark.parametrize(
    "text, want",
    [("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:80", ("::1", 80)), ("host:65535", ("host", 65535))],
)
def test_parse_address(text: str, want: tuple[str, int]) -> None:
    assert parse_address(text) == want


@pytest.mark.parametrize("text", ["foo", ":80", "h:x", "h:70000", "h:-1"])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_address(text)


def test_frames_survive_byte_by_byte_delivery() -> None:
    a, b = socket.socketpair()
    rx = FramedConnection(b)
    msgs = [protocol.Ack(request_id=f"r{i}") for i in range(3)]
    data = b"".join(struct.pack(">I", len(e)) + e for e in map(protocol.encode, msgs))
    got: list[protocol.Message] = []
    for i in range(len(data)):
        a.send(data[i : i + 1])
        got += rx.receive()
    assert got == msgs
    a.close()
    with pytest.raises(ConnectionClosed):
        rx.receive()
    rx.close()


def test_oversize_frame_header_is_refused_before_reading_it() -> None:
    a, b = socket.socketpair()
    rx = FramedConnection(b)
    a.send(struct.pack(">I", fields.MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        rx.receive()
    a.close()
    rx.close()


def test_proofs_bind_role_identity_and_nonces() -> None:
    n1, n2 = auth.make_nonce(), auth.make_nonce()
    p = auth.proof(b"s", "producer", "p", 0, n1, n2)
    assert auth.verify(p, auth.proof(b"s", "producer", "p", 0, n1, n2))
    for other in [
        auth.proof(b"t", "producer", "p", 0, n1, n2),
        auth.proof(b"s", "reader", "p", 0, n1, n2),
        auth.proof(b"s", "producer", "p", 1, n1, n2),
        auth.proof(b"s", "producer", "p", 0, n2, n1),
    ]:
        assert not auth.verify(p, other)


def test_secret_from_env_or_file(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    assert auth.load_secret() is None
    f = Path(str(tmp_path)) / "s"
    f.write_text("topsecret\n")
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(f))
    assert auth.load_secret() == b"topsecret"
    monkeypatch.setenv(auth.SECRET_ENV, "env")
    assert auth.load_secret() == b"env"
