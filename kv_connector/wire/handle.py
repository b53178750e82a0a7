"""A pull handle: the opaque string that names a pulled sample and where to fetch it.

A producer in pull mode puts it at the top of a finished request's ``kv_transfer_params``,
under ``"handle"``, the key speculators reads. It names the producer, the pull endpoint of
each of its ranks, the request and a nonce. A consumer passes it to
``reader.pull.client.PullClient.fetch``.

The string is ``kvhs1.`` and the URL-safe base64 of a msgpack ``PullHandle``. It is small
(about 100 characters for one rank), printable, and safe in JSON, a file name or a log
line. It is opaque to users, and strict to decode: a handle that does not decode, or
names anything out of range, is a ``HandleError``. The nonce is a random 128-bit hex
string the producer made for the request. Without it a request's sample cannot be
fetched, so a handle cannot be forged by guessing request ids. It carries no authority
beyond that: the endpoint's handshake authenticates a consumer (``wire.auth``). Pure logic.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kv_connector.common.errors import ConfigurationError
from kv_connector.wire.control import parse_address
from kv_connector.wire.fields import MAX_RANKS, RequestId, SafeName
from kv_connector.wire.protocol import PullNonce

PREFIX = "kvhs1."
MAX_HANDLE_CHARS = 64 << 10
Endpoint = Annotated[str, msgspec.Meta(min_length=3, max_length=270)]


class HandleError(ConfigurationError):
    """Not a pull handle of this version (malformed, truncated, out of range)."""


class PullHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """What a pull handle names.

    producer_id: the producer's name. request_id: vLLM's id of the request. nonce: the
    producer's secret for this request. endpoints: ``HOST:PORT`` of each rank's pull
    endpoint, by rank; there is one per tensor-parallel rank, and each serves its share."""

    producer_id: SafeName
    request_id: RequestId
    nonce: PullNonce
    endpoints: Annotated[list[Endpoint], msgspec.Meta(min_length=1, max_length=MAX_RANKS)]

    def __post_init__(self) -> None:
        for e in self.endpoints:
            # ValueError (a ValidationError when decoding)
            parse_address(e)

    def encode(self) -> str:
        raw = msgspec.msgpack.encode(self)
        return PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @property
    def world_size(self) -> int:
        return len(self.endpoints)


_decoder = msgspec.msgpack.Decoder(PullHandle)


def make_nonce() -> str:
    return secrets.token_hex(16)


def handle_of(handle: str | Mapping[str, Any]) -> str:
    """The handle string in ``handle`` or in a response's ``kv_transfer_params``;
    ``HandleError`` (saying why, as the record says) when the params carry none."""
    if isinstance(handle, Mapping):
        h = handle.get("handle")
        if h is None:
            record = handle.get("hidden_states")
            why = record.get("error") if isinstance(record, Mapping) else None
            raise HandleError(f"no handle in kv_transfer_params ({why or 'not pull delivery?'})")
        return str(h)
    return handle


def decode_handle(text: object) -> PullHandle:
    """The handle in ``text``; ``HandleError`` saying what is wrong otherwise."""
    if not isinstance(text, str):
        raise HandleError(f"a pull handle is a string, got {type(text).__name__}")
    if len(text) > MAX_HANDLE_CHARS or not text.startswith(PREFIX):
        raise HandleError(
            f"not a pull handle of this producer version (it starts {text[:12]!r}, expected {PREFIX!r})"
        )
    body = text[len(PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        return _decoder.decode(raw)
    except (binascii.Error, ValueError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HandleError(f"malformed pull handle: {e}") from None
