"""Wire protocol: the control messages between producers and readers, as msgspec Structs.

Every message on the control connection is one msgpack-encoded Struct of the tagged union
``Message`` inside a length-prefixed frame (see ``kv_connector.control``). The same
encoding carries the one data-plane message, ``WriteDone``, as a NIXL notification.

Decoding is strict: unknown fields, wrong types, out-of-range values and a wrong protocol
version all raise ``ProtocolError``; nothing from a peer is ever unpickled.

Version history (bump ``PROTOCOL_VERSION`` on any change to a Struct below):
    1: first version (Hello/Challenge/Auth/Welcome, CreditRequest/Grant/Ack, WriteDone).
    2: ``WriteDone.checksum`` (XXH3-64 of the rank's share, see ``kv_connector.integrity``)
       and ``Rewrite`` (the reader asks a rank to write its share again).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

PROTOCOL_VERSION = 2

MAX_FRAME_BYTES = 64 << 20
MAX_TOKENS = 1 << 22
MAX_LAYERS = 1024
MAX_RANKS = 1024
MAX_BLOCKS = 1 << 22
MAX_PAGES = 1 << 24
MAX_METADATA_BYTES = 16 << 20

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# Order of the dimensions inside one cache block of the cache-only layer.
# "LTH": [num_layers, block_size, hidden] (vLLM's CPU layout).
# "TLH": [block_size, num_layers, hidden] (vLLM's GPU layout).
LAYOUTS = ("LTH", "TLH")

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
RequestId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:@+=\-]{1,256}$")]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
WorldSize = Annotated[int, msgspec.Meta(gt=0, le=MAX_RANKS)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Digest = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Metadata = Annotated[bytes, msgspec.Meta(max_length=MAX_METADATA_BYTES)]
BlockIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_BLOCKS)]
PageIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_PAGES)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
LayerId = Annotated[int, msgspec.Meta(ge=-1, lt=1 << 16)]
Checksum = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1


class ProtocolError(ValueError):
    """A control message from a peer was malformed, out of range or unexpected."""


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class Hello(_Msg, tag="hello", frozen=True):
    """Producer -> reader, first message on a connection."""

    version: int
    producer_id: Name
    rank: Rank
    world_size: WorldSize
    agent_name: Name
    block_bytes: PosInt
    nonce: Nonce


class Challenge(_Msg, tag="challenge", frozen=True):
    """Reader -> producer: the reader's nonce and its proof of the shared secret
    (see ``kv_connector.auth``); the producer checks it before sending any metadata."""

    version: int
    nonce: Nonce
    digest: Digest
    auth_required: bool


class Auth(_Msg, tag="auth", frozen=True):
    """Producer -> reader: the producer's proof of the secret and its NIXL metadata."""

    digest: Digest
    agent_metadata: Metadata


class Welcome(_Msg, tag="welcome", frozen=True):
    """Reader -> producer after a successful handshake: where the receive pool lives."""

    reader_id: Name
    agent_name: Name
    agent_metadata: Metadata
    pool_addr: NonNegInt
    pool_bytes: PosInt
    page_bytes: PosInt
    num_pages: PosInt
    mem_type: Literal["DRAM", "VRAM"]
    device_id: NonNegInt


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything the reader needs to rebuild one sample from its cache blocks.

    token ``t`` of the sample lives in block ``t // block_size`` at offset
    ``t % block_size``; blocks are numbered in the request's block-table order.
    """

    request_id: RequestId
    token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_TOKENS)]
    layer_ids: Annotated[list[LayerId], msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]
    hidden_size: Annotated[int, msgspec.Meta(gt=0, le=1 << 20)]
    dtype: str
    layout: str
    block_size: Annotated[int, msgspec.Meta(gt=0, le=1 << 16)]
    num_blocks: Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCKS)]
    block_bytes: PosInt

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)


class CreditRequest(_Msg, tag="credit_request", frozen=True):
    """Producer -> reader: this rank will write ``blocks`` (indices into the manifest's
    blocks) of a sample once granted pages; ranks of one producer send the same manifest."""

    manifest: Manifest
    blocks: Annotated[list[BlockIndex], msgspec.Meta(max_length=MAX_BLOCKS)]


class Grant(_Msg, tag="grant", frozen=True):
    """Reader -> producer: pool pages for a sample, ``pages_per_block`` pages per block,
    block ``j`` piece ``k`` goes to ``pages[j * pages_per_block + k]``."""

    request_id: RequestId
    pages: Annotated[list[PageIndex], msgspec.Meta(min_length=1, max_length=MAX_PAGES)]
    pages_per_block: PosInt


class Ack(_Msg, tag="ack", frozen=True):
    """Reader -> producer: the sample was taken by the user; its blocks may be freed."""

    request_id: RequestId


class Refuse(_Msg, tag="refuse", frozen=True):
    """Either way: a request or the connection is refused; ``request_id`` empty means the
    whole connection."""

    code: Name
    message: Annotated[str, msgspec.Meta(max_length=4096)]
    request_id: str = ""


class WriteDone(_Msg, tag="write_done", frozen=True):
    """Producer -> reader as a NIXL notification attached to a rank's WRITE: the blocks
    that rank promised in its credit request have landed in their granted pages;
    ``checksum`` is the XXH3-64 of those blocks' sample bytes (None: not computed)."""

    request_id: RequestId
    checksum: Checksum | None = None


class Rewrite(_Msg, tag="rewrite", frozen=True):
    """Reader -> producer: the rank's share of a sample did not match its checksum;
    write it again into the same pages."""

    request_id: RequestId
    reason: Annotated[str, msgspec.Meta(max_length=4096)] = ""


Message = Hello | Challenge | Auth | Welcome | CreditRequest | Grant | Ack | Refuse | WriteDone | Rewrite

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    """Encode one message as msgpack."""
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode and validate one message; raise ``ProtocolError`` on anything malformed."""
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg: Message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed message: {e}") from None
    except Exception as e:  # msgspec may raise e.g. RecursionError on hostile input
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from None
    if isinstance(msg, CreditRequest):
        check_manifest(msg.manifest)
        for b in msg.blocks:
            if b >= msg.manifest.num_blocks:
                raise ProtocolError(f"block index {b} outside the sample's {msg.manifest.num_blocks} blocks")
        if len(set(msg.blocks)) != len(msg.blocks):
            raise ProtocolError("duplicate block indices in a credit request")
    if isinstance(msg, (Hello, Challenge)) and msg.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {msg.version} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); run the same kv_connector version on both ends"
        )
    return msg


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ProtocolError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPE_SIZES)}") from None


def check_manifest(m: Manifest) -> None:
    """Cross-field checks msgspec cannot express; raise ``ProtocolError``."""
    if m.layout not in LAYOUTS:
        raise ProtocolError(f"unknown block layout {m.layout!r}; expected one of {LAYOUTS}")
    item = dtype_size(m.dtype)
    expected = m.block_size * m.num_layers * m.hidden_size * item
    if m.block_bytes != expected:
        raise ProtocolError(f"block_bytes {m.block_bytes} != block_size*layers*hidden*itemsize = {expected}")
    need = math.ceil(m.num_tokens / m.block_size)
    if m.num_blocks != need:
        raise ProtocolError(
            f"{m.num_tokens} tokens in blocks of {m.block_size} need {need} blocks, "
            f"manifest says {m.num_blocks}"
        )
