"""The handshake of a control connection, both ends: Hello -> Challenge -> Auth -> Welcome.

    producer                                   reader
    Hello(id, rank, world, agent, nonce)  ->
                                          <-   Challenge(nonce', proof of the secret)
    (checks the reader's proof first)
    Auth(proof of the secret, metadata)   ->
                                               (checks the proof, loads the metadata)
                                          <-   Welcome(metadata, pool, page size)

With a shared secret both sides prove it (``kv_connector.wire.auth``) before any NIXL
metadata, and with it any memory key, leaves a node; the producer checks the reader's
proof before it sends its own metadata. Each phase of the reader's side bounds the frame
it accepts (``FRAME_LIMITS``): a peer that has not proven anything may not make the
reader buffer more than a Hello. The whole handshake must end within
``HANDSHAKE_TIMEOUT_S``.

``as_producer`` runs the producer's side over a connection (blocking, with a deadline);
``ReaderHandshake`` is the reader's side of one connection as a state machine (pure: the
reader's shell reads frames, feeds them here and sends what comes back).
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass, field

import msgspec

from kv_connector.common.errors import RefusedError
from kv_connector.wire import auth, fields, protocol
from kv_connector.wire.control import FramedConnection
from kv_connector.wire.protocol import ProtocolError
from kv_connector.wire.transport import MemType

# the whole handshake, every message included
HANDSHAKE_TIMEOUT_S = 10.0


class HandshakeError(RefusedError):
    """The handshake failed on the producer's side (refused, unauthenticated, malformed)."""


class Phase(enum.Enum):
    """Where a connection is, on the reader's side."""

    # accepted; the next frame must be a Hello
    HELLO = "hello"
    # challenged; the next frame must be an Auth (or a Refuse)
    AUTH = "auth"
    # welcomed: credit requests and refusals
    READY = "ready"


FRAME_LIMITS: dict[Phase, int] = {
    Phase.HELLO: 4 << 10,
    Phase.AUTH: fields.MAX_METADATA_BYTES + (4 << 10),
    Phase.READY: fields.MAX_FRAME_BYTES,
}
# what a producer accepts from a reader before and after its Welcome
CHALLENGE_LIMIT = FRAME_LIMITS[Phase.HELLO]
WELCOME_LIMIT = FRAME_LIMITS[Phase.AUTH]


@dataclass(frozen=True)
class ProducerIdentity:
    producer_id: str
    rank: int
    world_size: int
    agent_name: str
    block_bytes: int
    # where the cache lives (the reader's checksum policy)
    cache_mem: MemType = "DRAM"
    # how its shares' checksums are computed
    checksum_kind: protocol.ShareChecksum = protocol.ShareChecksum.XXH3
    # runs of pages it asks to be granted ahead (``protocol.Credit``)
    credits_ahead: int = 0


def as_producer(
    conn: FramedConnection,
    me: ProducerIdentity,
    secret: bytes | None,
    metadata: bytes,
    timeout: float = HANDSHAKE_TIMEOUT_S,
) -> protocol.Welcome:
    """The producer's side, over a fresh connection; returns the reader's Welcome or
    raises ``HandshakeError`` (or the connection's errors: OSError, TimeoutError,
    ConnectionClosed, ProtocolError). The caller closes the connection on failure."""
    deadline = time.monotonic() + timeout
    nonce = auth.make_nonce()
    conn.max_frame = CHALLENGE_LIMIT
    conn.send(
        protocol.Hello(
            version=protocol.PROTOCOL_VERSION,
            producer_id=me.producer_id,
            rank=me.rank,
            world_size=me.world_size,
            agent_name=me.agent_name,
            block_bytes=me.block_bytes,
            nonce=nonce,
            cache_mem=me.cache_mem,
            checksum_kind=me.checksum_kind,
            credits_ahead=me.credits_ahead,
        )
    )
    ch = conn.receive_one(max(0.0, deadline - time.monotonic()))
    if isinstance(ch, protocol.Refuse):
        raise HandshakeError(f"reader refused: {ch.message}")
    if not isinstance(ch, protocol.Challenge):
        raise HandshakeError(f"expected a challenge, got {type(ch).__name__}")
    if ch.auth_required and secret is None:
        _refuse(conn, "the producer has no shared secret (KV_CONNECTOR_SECRET)")
        raise HandshakeError("the reader requires a shared secret; set KV_CONNECTOR_SECRET")
    if secret is not None:
        want = auth.proof(secret, "reader", me.producer_id, me.rank, nonce, ch.nonce)
        if not auth.verify(want, ch.proof):
            _refuse(conn, "the reader's proof does not match the producer's shared secret")
            raise HandshakeError("the reader failed authentication (wrong or no shared secret)")
    digest = auth.proof(
        secret, "producer", me.producer_id, me.rank, nonce, ch.nonce, binding=auth.digest_of(metadata)
    )
    conn.max_frame = WELCOME_LIMIT
    conn.send(protocol.Auth(proof=digest, agent_metadata=metadata))
    w = conn.receive_one(max(0.0, deadline - time.monotonic()))
    if isinstance(w, protocol.Refuse):
        raise HandshakeError(f"reader refused: {w.message}")
    if not isinstance(w, protocol.Welcome):
        raise HandshakeError(f"expected welcome, got {type(w).__name__}")
    if secret is not None:
        want = welcome_proof(secret, me.producer_id, me.rank, nonce, ch.nonce, w)
        if not auth.verify(want, w.proof):
            _refuse(conn, "the reader's Welcome does not carry its proof (altered on the way?)")
            raise HandshakeError("the reader's Welcome failed authentication (altered on the way?)")
        conn.mac = auth.SessionMac(
            auth.session_key(secret, me.producer_id, me.rank, nonce, ch.nonce), "to_reader"
        )
    conn.max_frame = fields.MAX_FRAME_BYTES
    return w


def welcome_proof(
    secret: bytes | None,
    producer_id: str,
    rank: int,
    producer_nonce: bytes,
    reader_nonce: bytes,
    welcome: protocol.Welcome,
) -> bytes:
    """The reader's proof bound to every field of its Welcome."""
    return auth.proof(
        secret,
        "welcome",
        producer_id,
        rank,
        producer_nonce,
        reader_nonce,
        binding=auth.digest_of(welcome.binding()),
    )


def _refuse(conn: FramedConnection, why: str) -> None:
    """Tell the reader why this producer turns away (it logs it), then go."""
    with contextlib.suppress(OSError):
        conn.send(protocol.Refuse(code="auth", message=fields.clip_text(why)))


@dataclass
class ReaderHandshake:
    """The reader's side of one connection (pure: no I/O)."""

    secret: bytes | None
    t_accept: float
    phase: Phase = Phase.HELLO
    hello: protocol.Hello | None = None
    nonce: bytes = field(default_factory=auth.make_nonce)

    @property
    def frame_limit(self) -> int:
        return FRAME_LIMITS[self.phase]

    def expired(self, now: float) -> bool:
        """Not through the handshake within ``HANDSHAKE_TIMEOUT_S`` of being accepted."""
        return self.phase is not Phase.READY and now - self.t_accept > HANDSHAKE_TIMEOUT_S

    def on_hello(
        self, msg: protocol.Message, known_world: int | None, rank_taken: bool
    ) -> protocol.Challenge:
        """HELLO -> AUTH: the reader's nonce and proof. ``known_world``: the world size this
        producer's other ranks announced; ``rank_taken``: this rank is connected already."""
        if self.phase is not Phase.HELLO:
            raise ProtocolError(f"a hello in phase {self.phase.value}")
        if not isinstance(msg, protocol.Hello):
            raise ProtocolError(f"expected hello, got {type(msg).__name__}")
        if known_world is not None and known_world != msg.world_size:
            raise ProtocolError(
                f"producer {msg.producer_id} said world size {known_world} before, now {msg.world_size}"
            )
        if msg.rank >= msg.world_size:
            raise ProtocolError(f"rank {msg.rank} outside world size {msg.world_size}")
        if rank_taken:
            raise ProtocolError(f"producer {msg.producer_id} rank {msg.rank} is already connected")
        self.hello = msg
        self.phase = Phase.AUTH
        return protocol.Challenge(
            version=protocol.PROTOCOL_VERSION,
            nonce=self.nonce,
            proof=auth.proof(self.secret, "reader", msg.producer_id, msg.rank, msg.nonce, self.nonce),
            auth_required=self.secret is not None,
        )

    def on_auth(self, msg: protocol.Auth) -> None:
        """Check the producer's proof, bound to the metadata it sends (with a secret); the
        caller then loads its metadata and, if that works, calls ``welcome``."""
        if self.phase is not Phase.AUTH or self.hello is None:
            raise ProtocolError(f"an auth in phase {self.phase.value}")
        if self.secret is not None:
            h = self.hello
            binding = auth.digest_of(msg.agent_metadata)
            want = auth.proof(self.secret, "producer", h.producer_id, h.rank, h.nonce, self.nonce, binding)
            if not auth.verify(want, msg.proof):
                raise ProtocolError(
                    "authentication failed: wrong shared secret (or metadata altered on the way)"
                )

    def welcome(self, unsealed: protocol.Welcome) -> protocol.Welcome:
        """AUTH -> READY: ``unsealed`` with the reader's proof bound to it; from now on the
        connection's frames carry the session's tags (``session``)."""
        if self.phase is not Phase.AUTH or self.hello is None:
            raise ProtocolError(f"a welcome in phase {self.phase.value}")
        self.phase = Phase.READY
        h = self.hello
        proof = welcome_proof(self.secret, h.producer_id, h.rank, h.nonce, self.nonce, unsealed)
        return msgspec.structs.replace(unsealed, proof=proof)

    def session(self) -> auth.SessionMac | None:
        """The reader's side of the session's tags (None without a secret)."""
        if self.secret is None or self.hello is None:
            return None
        h = self.hello
        return auth.SessionMac(
            auth.session_key(self.secret, h.producer_id, h.rank, h.nonce, self.nonce), "to_producer"
        )
