"""Wire protocol: the control messages between producers and readers, as msgspec Structs.

Every message on the control connection is one msgpack-encoded Struct of the tagged union
``Message`` inside a length-prefixed frame (see ``kv_connector.wire.control``). The same
encoding carries the one data-plane message, ``WriteDone``, as a NIXL notification.

Decoding is strict: unknown fields, wrong types, out-of-range values, inconsistent
records (checked in each Struct's ``__post_init__``, which runs on decoding as on
building) and a wrong protocol version all raise ``ProtocolError``; nothing from a peer
is ever unpickled. Kinds are types: refusal codes, layouts and dtypes are ``Literal``s
that decoding validates.

Version history (bump ``PROTOCOL_VERSION`` on any change to a Struct below), one line each:
    1: Hello/Challenge/Auth/Welcome, CreditRequest/Grant/Ack, WriteDone.
    2: ``WriteDone.checksum`` (XXH3-64 of a rank's share, ``wire.integrity``); ``Rewrite``.
    3: ``Manifest.geometry`` (a ``layout.BlockLayout``); ``Refuse.code`` a ``RefuseCode``.
    4: ``Grant`` names one run of pages; ``WriteDone.checksum_follows`` and ``LateChecksum``.
    5: (skipped: taken by a branch merged as 7.)
    6: proofs cover NIXL metadata and every Welcome field; session tags; ``Hello.cache_mem``.
    7: ``Manifest.sample_id``/``metadata`` (``wire.identity``), covered by the checksum.
    8: ``Hello.digest``: "xxh3" over bytes or "blocks" (``wire.block_digest``).
    9: pull delivery: ``PullFetch``/``PullShare``, ``PullRelease``/``PullReleased``, ``PullError``.
    10: ``PullShare.digest``: which ``ShareChecksum`` its checksum is ("xxh3" or "blocks").
    11: ``ShareChecksum.FINGERPRINT`` (``wire.fingerprint``, the default); ``PullShare.block_pitch``
        (pull from caches in padded pages).
    12: ``PullShare.fence`` (``HoldFence``: the hold's fence word, READ after the data);
        ``PullRelease.answer`` (False: a release nobody waits for).
    13: ``Grant.generation``, named by ``WriteDone.generation``; ``Fenced`` (push's fence:
        no WRITE of a dropped sample's grant is in flight any more).
    14: ``Manifest.provenance`` (``wire.provenance``: vLLM version, model runner, model);
        ``RefuseCode`` "mismatch" (a sample other than the consumer expects).
    15: ``PullKeep``/``PullKept``: a consumer still starting keeps a sample's hold.
    16: credits ahead for a producer of one rank: ``Hello.credits_ahead``, ``Credit`` (a run of
        pages granted before any sample needs it), ``Placed`` (a sample written into one, no
        round trip), ``CreditRecall`` and ``CreditReturned``.
    17: one word a record: ``checksum`` its value, ``checksum_kind`` its kind (``Hello``,
        ``PullShare``; were ``digest``); ``WriteDone.checksum_follows`` and ``LateChecksum``
        (were ``digest_follows`` and ``ShareDigest``); ``Challenge.proof``, ``Auth.proof``.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Literal

import msgspec

from kv_connector.common.errors import ConfigurationError, WireError
from kv_connector.wire.fields import (
    MAX_BLOCKS,
    MAX_FRAME_BYTES,
    MAX_PAGES,
    MAX_TEXT_CHARS,
    MAX_TOKENS,
    REQUEST_ID_PATTERN,
    BlockIndex,
    Checksum,
    Generation,
    LayerId,
    Metadata,
    Nonce,
    NonNegInt,
    PageIndex,
    PosInt,
    Proof,
    Rank,
    RequestId,
    SafeName,
    SampleId,
    SampleMetadata,
    TokenId,
    WorldSize,
)
from kv_connector.wire.layout import MAX_LAYERS, BlockLayout, blocks_for, stripe
from kv_connector.wire.provenance import Provenance
from kv_connector.wire.transport import MemType

PROTOCOL_VERSION = 17
# runs of pages a reader may grant one producer ahead of its samples
MAX_CREDITS_AHEAD = 8

class ProtocolError(WireError, ValueError):
    """A control message from a peer was malformed, out of range or unexpected."""


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class ShareChecksum(str, enum.Enum):
    """How a rank computes its shares' checksums, resolved once where the rank starts
    (``ChecksumOption.resolve``) and carried as this value to the reader."""

    # XXH3-64 over the share's bytes (``integrity``)
    XXH3 = "xxh3"
    # XXH3-64 over per-block digests computed where the cache is (``block_digest``)
    BLOCKS = "blocks"
    # XXH3-64 over a few words of every token slot, taken in the step that wrote it (``fingerprint``)
    FINGERPRINT = "fingerprint"


class Hello(_Msg, tag="hello", frozen=True):
    """Producer -> reader, first message on a connection. ``cache_mem``: where the
    producer's cache lives (a reader requires checksums from host-memory caches by
    default: hashing them costs little); ``checksum_kind``: how its shares' checksums are computed
    (``ShareChecksum``)."""

    version: int
    producer_id: SafeName
    rank: Rank
    world_size: WorldSize
    agent_name: SafeName
    block_bytes: PosInt
    nonce: Nonce
    cache_mem: MemType = "DRAM"
    checksum_kind: ShareChecksum = ShareChecksum.XXH3
    # runs of pages this rank asks to be granted ahead of its samples (``Credit``); a reader
    # grants them to a producer of one rank only (TP ranks must write the same pages)
    credits_ahead: Annotated[int, msgspec.Meta(ge=0, le=MAX_CREDITS_AHEAD)] = 0


class Challenge(_Msg, tag="challenge", frozen=True):
    """Reader -> producer: the reader's nonce and its proof of the shared secret
    (see ``kv_connector.wire.auth``); the producer checks it before sending any metadata."""

    version: int
    nonce: Nonce
    proof: Proof
    auth_required: bool


class Auth(_Msg, tag="auth", frozen=True):
    """Producer -> reader: the producer's proof of the secret, bound to its NIXL metadata."""

    proof: Proof
    agent_metadata: Metadata


class Welcome(_Msg, tag="welcome", frozen=True):
    """Reader -> producer after a successful handshake: where the receive pool lives, and
    the reader's proof bound to all of it (``welcome_binding``)."""

    reader_id: SafeName
    agent_name: SafeName
    agent_metadata: Metadata
    pool_addr: NonNegInt
    pool_bytes: PosInt
    page_bytes: PosInt
    num_pages: PosInt
    mem_type: MemType
    device_id: NonNegInt
    proof: Proof

    def __post_init__(self) -> None:
        if self.pool_addr + self.pool_bytes > 1 << 64:
            raise ConfigurationError("the pool does not fit in a 64-bit address space")
        if self.page_bytes > self.pool_bytes or self.num_pages * self.page_bytes > self.pool_bytes:
            raise ConfigurationError("the pool's pages do not fit in the pool")

    def binding(self) -> bytes:
        """What the reader's proof covers: every field but the proof."""
        names = ("reader_id", "agent_name", "agent_metadata", "pool_addr", "pool_bytes", "page_bytes")
        fields = [getattr(self, n) for n in (*names, "num_pages", "mem_type", "device_id")]
        return msgspec.msgpack.encode(fields)


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything the reader needs to rebuild one sample from its cache blocks.

    token ``t`` of the sample lives in block ``t // block_size`` at offset
    ``t % block_size``; blocks are numbered in the request's block-table order;
    ``geometry`` is one block's shape in the producer's cache. ``sample_id``: the user's
    name for the sample (None: none given); ``metadata``: the JSON encoding of the user's
    metadata object (empty: none given); ``provenance``: what produced it (None: a
    producer that does not know, such as a test's sender).
    """

    request_id: RequestId
    token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_TOKENS)]
    layer_ids: Annotated[list[LayerId], msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]
    geometry: BlockLayout
    num_blocks: Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCKS)]
    sample_id: SampleId | None = None
    metadata: SampleMetadata = b""
    provenance: Provenance | None = None

    def __post_init__(self) -> None:
        if self.metadata:
            try:
                obj = msgspec.json.decode(self.metadata)
            # msgspec's errors, or RecursionError on deep nesting
            except Exception as e:
                raise ConfigurationError(f"sample metadata is not JSON: {type(e).__name__}") from None
            if not isinstance(obj, dict):
                raise ConfigurationError("sample metadata is not a JSON object")
        if len(self.layer_ids) != self.geometry.num_layers:
            raise ConfigurationError(
                f"{len(self.layer_ids)} layer ids for blocks of {self.geometry.num_layers} layers"
            )
        need = blocks_for(len(self.token_ids), self.geometry.block_size)
        if self.num_blocks != need:
            raise ConfigurationError(
                f"{len(self.token_ids)} tokens in blocks of {self.geometry.block_size} need {need} "
                f"blocks, manifest says {self.num_blocks}"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    @property
    def hidden_size(self) -> int:
        return self.geometry.hidden_size

    @property
    def dtype(self) -> str:
        return self.geometry.dtype

    def valid_spans(self, block_index: int) -> list[tuple[int, int]]:
        """The bytes of block ``block_index`` that hold this sample's tokens."""
        return self.geometry.valid_spans(self.num_tokens, block_index)


class CreditRequest(_Msg, tag="credit_request", frozen=True):
    """Producer -> reader: this rank will write ``blocks`` (indices into the manifest's
    blocks) of a sample once granted pages; ranks of one producer send the same manifest."""

    manifest: Manifest
    blocks: Annotated[list[BlockIndex], msgspec.Meta(max_length=MAX_BLOCKS)]

    def __post_init__(self) -> None:
        for b in self.blocks:
            if b >= self.manifest.num_blocks:
                raise ConfigurationError(
                    f"block index {b} outside the sample's {self.manifest.num_blocks} blocks"
                )
        if len(set(self.blocks)) != len(self.blocks):
            raise ConfigurationError("duplicate block indices in a credit request")


class Grant(_Msg, tag="grant", frozen=True):
    """Reader -> producer: the run of pool pages ``first_page .. first_page + num_pages``
    for a sample; its blocks go where ``layout.BlockLayout.arranged_spans`` puts them in
    the run (which starts at ``first_page * page_bytes``)."""

    request_id: RequestId
    first_page: PageIndex
    num_pages: Annotated[int, msgspec.Meta(gt=0, le=MAX_PAGES)]
    # unique to this grant; every WRITE into its pages names it
    generation: Generation

    @property
    def pages(self) -> range:
        return range(self.first_page, self.first_page + self.num_pages)


class Credit(_Msg, tag="credit", frozen=True):
    """Reader -> producer (one that asked for credits ahead): the run of pool pages
    ``first_page .. first_page + num_pages``, granted before any sample needs it. The
    producer places its next new sample at the run's start (``Placed``) and WRITEs at
    once, or gives the run back (``CreditReturned``); a lost connection voids it."""

    # unique to this run; the WRITE of the sample placed in it names it
    generation: Generation
    first_page: PageIndex
    num_pages: Annotated[int, msgspec.Meta(gt=0, le=MAX_PAGES)]

    @property
    def pages(self) -> range:
        return range(self.first_page, self.first_page + self.num_pages)


class Placed(_Msg, tag="placed", frozen=True):
    """Producer -> reader: this rank's sample (all its blocks: a producer of one rank) is
    placed at the start of credit ``generation``; its WRITE follows without an answer, and
    the pages beyond the sample's go back to the pool. Sent before the WRITE is posted."""

    manifest: Manifest
    blocks: Annotated[list[BlockIndex], msgspec.Meta(max_length=MAX_BLOCKS)]
    generation: Generation

    def __post_init__(self) -> None:
        if sorted(self.blocks) != list(range(self.manifest.num_blocks)):
            raise ConfigurationError("a placed sample is written whole, by its producer's only rank")


class CreditRecall(_Msg, tag="credit_recall", frozen=True):
    """Reader -> producer: give credit ``generation`` back if no sample is placed in it yet
    (another sample waits for pages). A credit already placed is not answered: its
    ``Placed`` is on its way."""

    generation: Generation


class CreditReturned(_Msg, tag="credit_returned", frozen=True):
    """Producer -> reader: credit ``generation`` is given back unused (nothing was written
    into it): its pages are the pool's again."""

    generation: Generation


class Ack(_Msg, tag="ack", frozen=True):
    """Reader -> producer: the sample was taken by the user; its blocks may be freed."""

    request_id: RequestId


# Why a peer refuses: "protocol" (a malformed or unexpected message), "auth" (the
# handshake's proof), "pool_too_small" (a sample larger than the reader's pool),
# "checksum" (a share kept failing its checksum), "write_failed" (a producer gave up on
# a sample whose WRITE kept failing).
# "timeout" (a sample not complete in time), "limit" (a peer over its bounds),
# "preempted" (a request preempted before its WRITE could finish), "unchecked" (a share
# without the checksum the reader requires), "rejected" (the consumer will not take a
# sample: its states are non-finite or all zero for a token, or its file cannot be written),
# "mismatch" (the sample is not what the consumer expects: layer ids, dtype, hidden size, model).
RefuseCode = Literal[
    "protocol",
    "auth",
    "pool_too_small",
    "checksum",
    "write_failed",
    "timeout",
    "limit",
    "preempted",
    "unchecked",
    "rejected",
    "mismatch",
]


class Refuse(_Msg, tag="refuse", frozen=True):
    """Either way: a request or the connection is refused; ``request_id`` empty means the
    whole connection."""

    code: RefuseCode
    message: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
    request_id: Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z0-9_.:@+=\-]{1,256})?\Z")] = ""


class WriteDone(_Msg, tag="write_done", frozen=True):
    """Producer -> reader as a NIXL notification attached to a rank's WRITE: the blocks
    that rank promised in its credit request have landed in their granted pages;
    ``checksum`` is the XXH3-64 of those blocks' sample bytes (or of their block digests,
    as the Hello said); None with
    ``checksum_follows``: it comes in a ``LateChecksum`` once computed; None without: none
    (checksums off)."""

    request_id: RequestId
    # the grant whose pages it wrote (a stale one never lands)
    generation: Generation
    checksum: Checksum | None = None
    checksum_follows: bool = False

    def __post_init__(self) -> None:
        if self.checksum_follows and self.checksum is not None:
            raise ConfigurationError("a WriteDone with a checksum has no checksum to follow")


class LateChecksum(_Msg, tag="late_checksum", frozen=True):
    """Producer -> reader: the checksum of this rank's share of a sample, for a WRITE
    that was posted before the checksum was ready (its WriteDone said it follows)."""

    request_id: RequestId
    checksum: Checksum


class Fenced(_Msg, tag="fenced", frozen=True):
    """Producer -> reader: this rank's job of a sample ended undelivered (refused, or
    failed here) and no WRITE of it into grant ``generation``'s pages is in flight any
    more: the reader may give those pages to another sample."""

    request_id: RequestId
    generation: Generation


class Rewrite(_Msg, tag="rewrite", frozen=True):
    """Reader -> producer: the rank's share of a sample did not match its checksum;
    write it again into the same pages."""

    request_id: RequestId
    reason: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)] = ""


# ---- pull delivery: a consumer asks a producer's rank for its share of one sample
PullNonce = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16,64}\Z")]
# Why a rank gives no share ("unknown": never held here, or a wrong nonce; the others
# name how the hold ended, see ``kv_connector.producer.pull.ledger``).
PullErrorCode = Literal["unknown", "expired", "released", "preempted", "aborted", "closed", "failed"]


class PullFetch(_Msg, tag="pull_fetch", frozen=True):
    """Consumer -> producer rank: this rank's share of a sample, by its handle's names."""

    request_id: RequestId
    nonce: PullNonce


class HoldFence(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a held sample's fence word lies (``producer.pull.hold_fences``): ``offset`` bytes
    into the rank's fence table (``table_addr``, ``table_bytes``, host memory the NIXL
    metadata of the handshake registers). It reads ``value`` while the hold is live; a
    consumer READs it after its data READ completed and fails the sample otherwise."""

    table_addr: NonNegInt
    table_bytes: PosInt
    offset: NonNegInt
    value: PosInt

    def __post_init__(self) -> None:
        if self.offset % 8 or self.offset + 8 > self.table_bytes:
            raise ConfigurationError(
                f"a fence word at {self.offset} is not one of the table's {self.table_bytes} bytes"
            )
        if self.table_addr + self.table_bytes > 1 << 64:
            raise ConfigurationError("the fence table does not fit in a 64-bit address space")


class PullShare(_Msg, tag="pull_share", frozen=True):
    """Producer rank -> consumer: the sample's manifest, and where this rank's share lies
    in its cache: block ``first_block + i`` of the sample is cache block ``block_ids[i]``,
    at ``cache_addr + block_ids[i] * pitch`` in the memory the NIXL metadata of the
    handshake registers (``pitch``: ``block_pitch``, the bytes from one cache block to the
    next, more than a block where vLLM padded the page; None: ``manifest.block_bytes``);
    ``checksum``: the share's (None: checksums off), computed as ``checksum_kind`` says: XXH3-64
    over its bytes (``wire.integrity``) or over its block digests (``wire.block_digest``,
    taken where the cache is); ``fence``: the hold's fence (None: the rank fences no hold
    now; the consumer then waits for its release's answer)."""

    manifest: Manifest
    rank: Rank
    world_size: WorldSize
    first_block: BlockIndex
    block_ids: Annotated[list[BlockIndex], msgspec.Meta(max_length=MAX_BLOCKS)]
    cache_addr: NonNegInt
    cache_bytes: PosInt
    mem_type: MemType
    device_id: NonNegInt
    checksum: Checksum | None = None
    checksum_kind: ShareChecksum = ShareChecksum.XXH3
    block_pitch: PosInt | None = None
    fence: HoldFence | None = None

    @property
    def pitch(self) -> int:
        return self.block_pitch or self.manifest.block_bytes

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ConfigurationError(f"rank {self.rank} outside world size {self.world_size}")
        want = stripe(self.manifest.num_blocks, self.rank, self.world_size)
        if range(self.first_block, self.first_block + len(self.block_ids)) != want:
            raise ConfigurationError(
                f"a share of blocks from {self.first_block} is not rank {self.rank}'s {want}"
            )
        if self.cache_addr + self.cache_bytes > 1 << 64:
            raise ConfigurationError("the cache does not fit in a 64-bit address space")
        bb = self.manifest.block_bytes
        if self.pitch < bb:
            raise ConfigurationError(f"cache blocks {self.pitch} bytes apart cannot hold blocks of {bb}")
        if any(b * self.pitch + bb > self.cache_bytes for b in self.block_ids):
            raise ConfigurationError(f"a block id lies outside the cache's {self.cache_bytes} bytes")


class PullRelease(_Msg, tag="pull_release", frozen=True):
    """Consumer -> producer rank: done with the sample; its blocks may be freed.
    ``answer``: False when the consumer checked the hold's fence and waits for nothing
    (no ``PullReleased``/``PullError`` comes back)."""

    request_id: RequestId
    nonce: PullNonce
    answer: bool = True


class PullKeep(_Msg, tag="pull_keep", frozen=True):
    """Consumer -> producer rank: a consumer holding the sample's handle is coming for it
    (its fetch agent is starting): keep it held (``PullKept``, or ``PullError``)."""

    request_id: RequestId
    nonce: PullNonce


class PullKept(_Msg, tag="pull_kept", frozen=True):
    """Producer rank -> consumer: the sample stays held ``held_s`` seconds more (the rank's
    bound on a kept hold may make that less than a whole ``pull_timeout_s``)."""

    request_id: RequestId
    held_s: Annotated[float, msgspec.Meta(ge=0)]


class PullReleased(_Msg, tag="pull_released", frozen=True):
    """Producer rank -> consumer: the sample was released."""

    request_id: RequestId


class PullError(_Msg, tag="pull_error", frozen=True):
    """Producer rank -> consumer: no share of this sample, and why."""

    request_id: RequestId
    code: PullErrorCode
    message: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]


Message = (
    Hello
    | Challenge
    | Auth
    | Welcome
    | CreditRequest
    | Grant
    | Credit
    | Placed
    | CreditRecall
    | CreditReturned
    | Ack
    | Refuse
    | WriteDone
    | Fenced
    | Rewrite
    | LateChecksum
    | PullFetch
    | PullShare
    | PullRelease
    | PullKeep
    | PullKept
    | PullReleased
    | PullError
)

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
    # msgspec may raise e.g. RecursionError on hostile input
    except Exception as e:
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from None
    if isinstance(msg, (Hello, Challenge)) and msg.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {msg.version} is not supported (this side speaks "
            f"{PROTOCOL_VERSION}); run the same kv_connector version on both ends"
        )
    return msg


_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


def request_id_problem(request_id: str) -> str | None:
    """Why ``request_id`` cannot travel as a sample's id (None: it can)."""
    if _REQUEST_ID.match(request_id):
        return None
    shown = request_id if len(request_id) <= 64 else request_id[:64] + "..."
    return (
        f"request id {shown!r} ({len(request_id)} characters) cannot name a sample: it must be 1 to 256 "
        "characters of A-Z a-z 0-9 _ . : @ + = -"
    )
