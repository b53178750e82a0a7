"""A sample's identity as the user gives it: ``sample_id`` and ``metadata``, validated.

Pure logic (no vllm, nixl or torch). A request's ``kv_transfer_params`` may carry
``"sample_id"`` (a string: which row of the user's dataset this is) and ``"metadata"`` (a
small JSON object). The scheduler side validates both when the request arrives
(``identity_of``): a bad one fails that request alone, with the error in its
``kv_transfer_params``. They travel in the manifest (``protocol.Manifest.sample_id`` and
``metadata``, the metadata as its JSON encoding) and come out as ``Sample.sample_id``
and ``Sample.metadata``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_connector.common.errors import ConfigurationError
from kv_connector.wire.fields import MAX_SAMPLE_ID_CHARS, MAX_SAMPLE_METADATA_BYTES, SAMPLE_ID_PATTERN

_SAMPLE_ID = re.compile(SAMPLE_ID_PATTERN)
SAMPLE_ID_CHARS = "letters, digits and _ . : @ + = -"


class IdentityError(ConfigurationError):
    """A request's ``sample_id`` or ``metadata`` is not acceptable; the message says why."""


@dataclass(frozen=True)
class SampleIdentity:
    """``sample_id``: None when the request gave none (the sample is then known by its
    request id). ``metadata_json``: the metadata object's JSON encoding (UTF-8), empty
    when none was given."""

    sample_id: str | None = None
    metadata_json: bytes = b""

    @property
    def metadata(self) -> dict[str, Any]:
        """The metadata object (empty when none was given)."""
        return decode_metadata(self.metadata_json)

    def name_of(self, request_id: str) -> str:
        """The sample's name: its own id, or its request's when it gave none."""
        return self.sample_id or request_id


NO_IDENTITY = SampleIdentity()


def check_sample_id(sample_id: object) -> str:
    """``sample_id`` if acceptable, else ``IdentityError`` naming the rule it breaks."""
    if not isinstance(sample_id, str):
        raise IdentityError(f"sample_id must be a string, got {type(sample_id).__name__}")
    if not 1 <= len(sample_id) <= MAX_SAMPLE_ID_CHARS:
        raise IdentityError(
            f"sample_id must have 1 to {MAX_SAMPLE_ID_CHARS} characters, got {len(sample_id)}"
        )
    if not _SAMPLE_ID.match(sample_id):
        raise IdentityError(f"sample_id {sample_id[:40]!r} may only contain {SAMPLE_ID_CHARS}")
    return sample_id


def encode_metadata(metadata: object) -> bytes:
    """The JSON encoding of a metadata object (``{}`` and None encode to nothing), or
    ``IdentityError``: not an object, not JSON (NaN, non-string keys, other types), or
    larger than ``MAX_SAMPLE_METADATA_BYTES`` encoded."""
    if metadata is None:
        return b""
    if not isinstance(metadata, Mapping):
        raise IdentityError(f"metadata must be a JSON object, got {type(metadata).__name__}")
    if not metadata:
        return b""
    try:
        text = json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise IdentityError(f"metadata is not plain JSON: {e}") from None
    except RecursionError:
        raise IdentityError("metadata is nested too deeply") from None
    data = text.encode()
    if len(data) > MAX_SAMPLE_METADATA_BYTES:
        raise IdentityError(
            f"metadata is {len(data)} bytes as JSON; at most {MAX_SAMPLE_METADATA_BYTES} are carried"
        )
    return data


def decode_metadata(data: bytes) -> dict[str, Any]:
    """The metadata object of its JSON encoding (``{}`` for none)."""
    if not data:
        return {}
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise IdentityError("sample metadata is not a JSON object")
    return obj


def make_identity(sample_id: str | None = None, metadata: Mapping[str, Any] | None = None) -> SampleIdentity:
    """A checked identity, or ``IdentityError``."""
    return SampleIdentity(
        None if sample_id is None else check_sample_id(sample_id), encode_metadata(metadata)
    )


def identity_of(params: Mapping[str, Any] | None) -> SampleIdentity:
    """The identity a request's ``kv_transfer_params`` give (none: ``NO_IDENTITY``), or
    ``IdentityError``."""
    if not params:
        return NO_IDENTITY
    sid = params.get("sample_id")
    return SampleIdentity(
        None if sid is None else check_sample_id(sid), encode_metadata(params.get("metadata"))
    )
