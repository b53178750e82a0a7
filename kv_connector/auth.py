"""Handshake authentication: a shared secret, HMAC-SHA256 challenge-response both ways.

The secret comes from the environment (``KV_CONNECTOR_SECRET``) or a file named by
``KV_CONNECTOR_SECRET_FILE``, never from a command line; it is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

SECRET_ENV = "KV_CONNECTOR_SECRET"
SECRET_FILE_ENV = "KV_CONNECTOR_SECRET_FILE"
NONCE_BYTES = 32


def make_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def load_secret() -> bytes | None:
    """The shared secret from the environment or its file, or None when neither is set."""
    value = os.environ.get(SECRET_ENV)
    if value:
        return value.encode()
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            with open(path, "rb") as f:
                data = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read the secret file named by {SECRET_FILE_ENV}: {e}") from None
        if not data:
            raise ValueError(f"the secret file named by {SECRET_FILE_ENV} is empty")
        return data
    return None


def proof(
    secret: bytes | None,
    role: str,
    producer_id: str,
    rank: int,
    producer_nonce: bytes,
    reader_nonce: bytes,
) -> bytes:
    """HMAC-SHA256 over the handshake transcript; ``role`` keeps the two directions apart."""
    transcript = b"\x00".join(
        [
            b"kv_connector/1",
            role.encode(),
            producer_id.encode(),
            str(rank).encode(),
            producer_nonce,
            reader_nonce,
        ]
    )
    return hmac.new(secret or b"", transcript, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)
