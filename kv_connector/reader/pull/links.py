"""The pull client's control connections, one per producer rank's endpoint, and ``FetchError``.

A connection is made on first use and handshaken in the reader's role (``wire.handshake``).
With a shared secret both ends prove it before the rank's NIXL metadata moves; that metadata
is loaded here into the client's agent. Each connection is checked to be the producer and
rank the handle names. It is made again once when it breaks, as when a producer restarted.
``FetchError`` is what a fetch raises.

Links without a transport (``transport=None``) serve a consumer whose NIXL agent does not
exist yet (``reader.agent.hold_keeper``). They load no metadata and announce the pool the
agent will have (``region``). They may only ask what needs no transfer (``PullKeep``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Literal

from kv_connector.common.errors import RefusedError
from kv_connector.wire import auth, fields, protocol
from kv_connector.wire.control import ConnectionClosed, FramedConnection
from kv_connector.wire.handle import PullHandle
from kv_connector.wire.handshake import HANDSHAKE_TIMEOUT_S, ReaderHandshake
from kv_connector.wire.protocol import ProtocolError, PullErrorCode
from kv_connector.wire.transport import Region, Transport, TransportError

# the client's pool pages (announced in its Welcome)
PAGE_BYTES = 64 << 10


# why a fetch failed: the producer's answers, then the client's own
FetchCode = Literal[
    PullErrorCode,
    "handle",
    "auth",
    "connect",
    "checksum",
    "values",
    "pool",
    "timeout",
    "transfer",
    "protocol",
    "mismatch",
    "agent",
]


class FetchError(RefusedError):
    """A sample could not be fetched; ``code`` (a ``FetchCode``) says why.

    The producer's answers: "expired", "unknown", "released", "preempted", "aborted",
    "closed", "failed". The client's own: "handle" (not a handle), "auth" (the handshake),
    "connect", "checksum", "values", "pool", "timeout", "transfer", "protocol",
    "mismatch" (not the sample ``expect`` describes), and "agent" (the rank's fetch agent)."""

    def __init__(self, code: FetchCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code: FetchCode = code
        self.message = message


@dataclass
class _Peer:
    """The control connection to one producer rank and its NIXL agent."""

    endpoint: str
    conn: FramedConnection
    agent: str
    lock: threading.Lock
    # producer id, rank, world size (its Hello)
    producer: tuple[str, int, int]


class ProducerLinks:
    """The client's connections to producer ranks, by endpoint (thread-safe)."""

    def __init__(
        self,
        name: str,
        secret: bytes | None,
        timeout_s: float,
        lock: threading.Lock,
        transport: Transport | None,
        region: Region,
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._secret = secret
        # the client's: guards the agent (held through a READ's post, which copies)
        self._lock = lock
        # guards ``_peers`` only: never waits for a READ
        self._peers_lock = threading.Lock()
        self._transport: Transport | None = transport
        self._region: Region | None = region
        self._peers: dict[str, _Peer] = {}

    def agent(self, endpoint: str) -> str:
        """The NIXL name of the rank at ``endpoint`` (connected by an ``ask``)."""
        with self._peers_lock:
            return self._peers[endpoint].agent

    def close(self) -> None:
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.conn.close()

    def ask(self, handle: PullHandle, rank: int, endpoint: str, msg: protocol.Message) -> protocol.Message:
        """One request and its answer on the rank's connection; a broken connection is made
        again (a producer restarted) once."""
        for attempt in (0, 1):
            peer = self._peer(handle, rank, endpoint)
            try:
                with peer.lock:
                    peer.conn.send(msg)
                    return peer.conn.receive_one(self.timeout_s)
            except (ConnectionClosed, OSError, TimeoutError, ProtocolError) as e:
                self._drop_peer(endpoint, peer)
                if attempt or isinstance(e, (TimeoutError, ProtocolError)):
                    raise FetchError("connect", f"the producer's rank {rank} at {endpoint}: {e}") from None
        raise AssertionError("unreachable")

    def tell(self, handle: PullHandle, rank: int, endpoint: str, msg: protocol.Message) -> bool:
        """Send one message that gets no answer, such as a fenced release, on the rank's connection.

        The connection is made if need be. False if it could not be sent; nothing is
        retried. It does not wait for an ``ask`` under way on the connection, since no answer
        comes of it to take that ask's place. The connection's sends are whole frames, one at
        a time."""

        try:
            peer = self._peer(handle, rank, endpoint)
        except FetchError:
            return False
        try:
            peer.conn.send(msg)
        except (ConnectionClosed, OSError):
            self._drop_peer(endpoint, peer)
            return False
        return True

    def _drop_peer(self, endpoint: str, peer: _Peer) -> None:
        with self._peers_lock:
            ours = self._peers.get(endpoint) is peer
            if ours:
                del self._peers[endpoint]
        if ours:
            with self._lock:
                if self._transport is not None:
                    self._transport.remove_peer(peer.agent)
        peer.conn.close()

    def _peer(self, handle: PullHandle, rank: int, endpoint: str) -> _Peer:
        with self._peers_lock:
            peer = self._peers.get(endpoint)
        if peer is not None:
            if peer.producer != (handle.producer_id, rank, handle.world_size):
                raise FetchError("unknown", _not_the_handles(endpoint, peer.producer, handle, rank))
            return peer
        peer = self._connect(handle, rank, endpoint)
        with self._peers_lock:
            old = self._peers.get(endpoint)
            if old is None:
                self._peers[endpoint] = peer
                return peer
        # another thread connected meanwhile
        peer.conn.close()
        return old

    def _connect(self, handle: PullHandle, rank: int, endpoint: str) -> _Peer:
        """Connect and run the handshake in the reader's role; load the rank's metadata."""
        secret = self._secret if self._secret is not None else auth.load_secret()
        try:
            conn = FramedConnection.connect(endpoint, timeout=min(self.timeout_s, HANDSHAKE_TIMEOUT_S))
        except OSError as e:
            raise FetchError(
                "connect", f"cannot reach the producer's rank {rank} at {endpoint}: {e}"
            ) from None
        try:
            return self._handshake(conn, handle, rank, endpoint, secret)
        except BaseException:
            conn.close()
            raise

    def _handshake(
        self, conn: FramedConnection, handle: PullHandle, rank: int, endpoint: str, secret: bytes | None
    ) -> _Peer:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        hs = ReaderHandshake(secret, time.monotonic())
        where = f"the producer's rank {rank} at {endpoint}"
        try:
            conn.max_frame = hs.frame_limit
            hello = conn.receive_one(deadline - time.monotonic())
            if not isinstance(hello, protocol.Hello):
                raise FetchError("protocol", f"{where} sent a {type(hello).__name__} instead of its Hello")
            producer = (hello.producer_id, hello.rank, hello.world_size)
            if producer != (handle.producer_id, rank, handle.world_size):
                raise FetchError("unknown", _not_the_handles(endpoint, producer, handle, rank))
            conn.send(hs.on_hello(hello, None, False))
            conn.max_frame = hs.frame_limit
            a = conn.receive_one(max(0.0, deadline - time.monotonic()))
            if isinstance(a, protocol.Refuse):
                raise FetchError("auth", f"{where} refused the handshake: {a.message}")
            if not isinstance(a, protocol.Auth):
                raise FetchError("protocol", f"{where} sent a {type(a).__name__} instead of its Auth")
            hs.on_auth(a)
            with self._lock:
                assert self._region is not None
                region = self._region
                # no agent yet: nothing to load, nothing to READ
                if self._transport is None:
                    agent, me = hello.agent_name, self.name
                else:
                    try:
                        agent = self._transport.add_peer(a.agent_metadata)
                    except TransportError as e:
                        why = f"{where}: its NIXL metadata does not load: {e}"
                        raise FetchError("protocol", why) from None
                    me = self._transport.name
            welcome = protocol.Welcome(
                reader_id=self.name,
                agent_name=me,
                # the producer never initiates a transfer
                agent_metadata=b"",
                pool_addr=region.addr,
                pool_bytes=region.nbytes,
                page_bytes=PAGE_BYTES,
                num_pages=region.nbytes // PAGE_BYTES,
                mem_type=region.mem_type,
                device_id=region.device_id,
                proof=bytes(32),
            )
            conn.send(hs.welcome(welcome))
            conn.mac = hs.session()
        except ProtocolError as e:
            code: FetchCode = "auth" if "authentication" in str(e) else "protocol"
            raise FetchError(code, f"{where}: {e}") from None
        except (ConnectionClosed, OSError, TimeoutError) as e:
            raise FetchError("connect", f"{where} closed the handshake: {e}") from None
        conn.max_frame = fields.MAX_FRAME_BYTES
        return _Peer(endpoint, conn, agent, threading.Lock(), producer)


def _not_the_handles(endpoint: str, producer: tuple[str, int, int], handle: PullHandle, rank: int) -> str:
    pid, r, world = producer
    return (
        f"{endpoint} serves producer {pid} rank {r}/{world}, not the handle's {handle.producer_id} rank "
        f"{rank}/{handle.world_size} (a stale handle?)"
    )
