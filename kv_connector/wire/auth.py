"""Handshake authentication and message integrity from one shared secret.

HMAC-SHA256 proofs go both ways, bound to what each side sends in the handshake, and a
session key then tags every later control message.

The secret comes from the environment (``KV_CONNECTOR_SECRET``) or a file named by
``KV_CONNECTOR_SECRET_FILE``, never from a command line; it is never logged. An empty one
is an error, not "no secret".

What the proofs bind (``transcript``): the role, which keeps the directions apart, the
producer's id and rank, both nonces, and a digest of what the proving side hands over.
The producer hands over its NIXL metadata (``Auth``); the reader its Welcome (pool
address, page size, NIXL metadata). A relay between a producer and a reader cannot swap
in its own metadata without the secret. After the handshake, ``session_key`` derives a
key from the secret and the transcript. ``SessionMac`` tags each control message with
its direction and sequence number. So a message cannot be forged, replayed, reordered or
moved to another connection. Every holder of the secret can act as either role: one
secret per trust domain.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from typing import Literal

from kv_connector.common.errors import ConfigurationError

SECRET_ENV = "KV_CONNECTOR_SECRET"
SECRET_FILE_ENV = "KV_CONNECTOR_SECRET_FILE"
NONCE_BYTES = 32
TAG_BYTES = 16

Role = Literal["reader", "producer", "welcome"]
Direction = Literal["to_reader", "to_producer"]


def make_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def load_secret() -> bytes | None:
    """The shared secret from the environment or its file, or None when neither is set.

    ``ValueError`` for a secret that is set but empty."""
    if SECRET_ENV in os.environ:
        value = os.environ[SECRET_ENV]
        if not value:
            raise ConfigurationError(f"{SECRET_ENV} is set but empty: set a secret, or unset it")
        return value.encode()
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read().strip()
        except OSError as e:
            raise ConfigurationError(f"cannot read the secret file named by {SECRET_FILE_ENV}: {e}") from None
        if not data:
            raise ConfigurationError(f"the secret file named by {SECRET_FILE_ENV} is empty")
        return data
    return None


def digest_of(*parts: bytes) -> bytes:
    """SHA-256 of ``parts``, each length-prefixed (no two sequences hash alike)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(struct.pack(">Q", len(p)))
        h.update(p)
    return h.digest()


def transcript(
    role: Role, producer_id: str, rank: int, producer_nonce: bytes, reader_nonce: bytes, binding: bytes = b""
) -> bytes:
    return digest_of(
        b"kv_connector/2",
        role.encode(),
        producer_id.encode(),
        str(rank).encode(),
        producer_nonce,
        reader_nonce,
        binding,
    )


def proof(
    secret: bytes | None,
    role: Role,
    producer_id: str,
    rank: int,
    producer_nonce: bytes,
    reader_nonce: bytes,
    binding: bytes = b"",
) -> bytes:
    """HMAC-SHA256 over the handshake transcript; ``binding`` is a digest of what the
    proving side hands over with it."""
    t = transcript(role, producer_id, rank, producer_nonce, reader_nonce, binding)
    return hmac.new(secret or b"", t, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def session_key(
    secret: bytes, producer_id: str, rank: int, producer_nonce: bytes, reader_nonce: bytes
) -> bytes:
    """The key that tags a connection's messages after its handshake."""
    return proof(secret, "welcome", producer_id, rank, producer_nonce, reader_nonce, b"session")


class SessionMac:
    """Tags for one side of one connection: ``seal`` what it sends, ``open`` what it receives.

    Each direction counts its messages, so a replayed, dropped or reordered message does
    not check."""

    def __init__(self, key: bytes, sends: Direction) -> None:
        self._key = key
        self._sends: Direction = sends
        self._receives: Direction = "to_producer" if sends == "to_reader" else "to_reader"
        self._sent = 0
        self._received = 0

    def _tag(self, direction: Direction, seq: int, payload: bytes) -> bytes:
        msg = direction.encode() + struct.pack(">Q", seq) + payload
        return hmac.new(self._key, msg, hashlib.sha256).digest()[:TAG_BYTES]

    def seal(self, payload: bytes) -> bytes:
        tag = self._tag(self._sends, self._sent, payload)
        self._sent += 1
        return payload + tag

    def open(self, frame: bytes) -> bytes | None:
        """The payload of a sealed frame, or None when its tag does not check."""
        if len(frame) < TAG_BYTES:
            return None
        payload, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(self._receives, self._received, payload)):
            return None
        self._received += 1
        return payload
