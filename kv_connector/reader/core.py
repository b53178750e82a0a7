"""HiddenStatesReader: the consumer side. Grants pool pages to producers, receives their
WRITEs, reassembles samples and hands them out; a sample's pages return to the pool (and
its producer gets an ``Ack``) once the sample was copied out."""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import mmap
import os
import queue
import selectors
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kv_connector import auth, protocol
from kv_connector.control import ConnectionClosed, FramedConnection, format_address, parse_address
from kv_connector.integrity import paged_checksum, spans_of_sample
from kv_connector.layout import pages_per_block
from kv_connector.pool import PagePool, PoolTooSmall
from kv_connector.protocol import ProtocolError
from kv_connector.transport import Region, Transport, TransportError

log = logging.getLogger(__name__)

DEFAULT_POOL_BYTES = 256 << 20
HANDSHAKE_TIMEOUT_S = 10.0  # a connection not through its handshake by then is closed
QUARANTINE_S = 5.0  # pages of a discarded sample wait this long: a late WRITE lands unseen
MAX_REWRITES = 3  # a share that fails its checksum is written again at most this often
LAST_NOTIFICATION_GRACE_S = 0.2  # how long a departed producer's last WriteDone may lag


class Sample(NamedTuple):
    """One request's captured hidden states.

    request_id: the producer's request id.
    token_ids: [num_tokens] int64.
    hidden_states: [num_tokens, num_captured_layers, hidden_size], the producer's dtype.
    layer_ids: the captured layer ids, in the order of ``hidden_states``' second dim.
    producer_id: which producer sent it.
    """

    request_id: str
    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    layer_ids: tuple[int, ...]
    producer_id: str = ""


HUGE_PAGE_MIN_BYTES = 2 << 20
DELIVERED_MEMORY = 100_000  # request ids remembered for acking resends
# Serving-thread polling while WRITEs are due (writers need our progress): SPIN_POLLS
# polls without sleeping after each event, then one every POLL_S; IDLE_POLL_S otherwise.
SPIN_POLLS = int(os.environ.get("KV_CONNECTOR_READER_SPIN_POLLS", "20"))
POLL_S = float(os.environ.get("KV_CONNECTOR_READER_POLL_S", "0.0002"))
IDLE_POLL_S = 0.05
PAGE_ALIGN = 64  # pool pages are multiples of this, so any dtype can view them


def _round_page(n: int) -> int:
    if n <= 0:
        raise ValueError(f"page size must be positive, got {n}")
    return -(-n // PAGE_ALIGN) * PAGE_ALIGN


def empty_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; large ones on anonymous memory advised to use
    transparent huge pages, which cuts the first-touch page-fault cost of a fresh
    sample (measured here: a 64 MiB copy-out at 1.0 GB/s on 4 KiB pages, 3.9 on huge
    pages). The tensor keeps its memory alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mem.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mem, dtype=torch.uint8).view(dtype).view(shape)


def listen_socket(listen: str | socket.socket) -> socket.socket:
    """A non-blocking listening socket: bound to ``HOST:PORT`` here, or the caller's
    socket (already bound: it keeps its port) put into the listening state."""
    if isinstance(listen, socket.socket):
        if listen.type != socket.SOCK_STREAM or listen.getsockname()[1] == 0:
            raise ValueError("the reader's listening socket must be a bound TCP socket")
        sock = listen
        sock.listen()
    else:
        host, port = parse_address(listen)
        sock = socket.create_server((host, port), reuse_port=False)
    sock.setblocking(False)
    return sock


class ReaderClosed(Exception):
    """The reader was closed while waiting for a sample."""


@dataclass
class _Peer:
    conn: FramedConnection
    addr: str
    fd: int
    state: str = "hello"  # hello -> auth -> ready
    t_accept: float = field(default_factory=time.monotonic)
    hello: protocol.Hello | None = None
    nonce: bytes = b""
    agent: str = ""
    requests: set[str] = field(default_factory=set)

    @property
    def label(self) -> str:
        h = self.hello
        return f"{h.producer_id}/rank{h.rank}@{self.addr}" if h else self.addr


@dataclass
class _Pending:
    manifest: protocol.Manifest
    producer_id: str
    world_size: int
    promised: dict[int, frozenset[int]] = field(default_factory=dict)  # rank -> blocks
    written: set[int] = field(default_factory=set)  # ranks whose WRITEs landed
    peers: dict[int, _Peer] = field(default_factory=dict)  # rank -> its current connection
    pages: list[int] | None = None
    ppb: int = 1
    complete: bool = False
    checksums: dict[int, int | None] = field(default_factory=dict)  # rank -> checksum of its share
    rewrites: int = 0

    def is_complete(self) -> bool:
        if len(self.promised) < self.world_size or self.pages is None:
            return False
        return all(r in self.written or not b for r, b in self.promised.items())


_Key = tuple[str, str]


class HiddenStatesReader:
    """Receives hidden states from producers over NIXL.

    ``listen``: control address ``HOST:PORT`` (port 0 picks one; ``address`` tells it),
    or a socket already bound to one (held by the caller, e.g. inherited from a
    supervisor, so the port is never released between choosing and listening); the
    reader listens on it and closes it with itself.
    ``pool_bytes``: receive pool size, registered with NIXL once.
    ``page_bytes``: pool page size (rounded up to a multiple of 64); by default the
    first producer's block size.
    ``secret``: shared secret for the handshake; by default from ``KV_CONNECTOR_SECRET``
    or ``KV_CONNECTOR_SECRET_FILE`` (none: producers are not authenticated).
    ``ack``: "on_take" acknowledges a sample to its producer (which then frees its
    blocks) when ``get`` hands it out; "manual" waits for ``ack(sample)``, e.g. after the
    sample was durably written.
    ``already_delivered(producer_id, request_id)``: samples delivered before this reader
    started (a ledger); a producer resending one gets its ``Ack`` without a transfer.
    ``verify``: check each share against the checksum (XXH3-64) its producer sent (on by default); a
    mismatch is logged with the request id and the share is written again (at most
    ``MAX_REWRITES`` times, then the sample is refused and its producer fails it).

    Iterate over it (or call ``get``) for ``Sample``s; use it as a context manager or call
    ``close``.
    """

    def __init__(
        self,
        listen: str | socket.socket = "127.0.0.1:0",
        pool_bytes: int = DEFAULT_POOL_BYTES,
        page_bytes: int | None = None,
        secret: bytes | None = None,
        name: str | None = None,
        ack: str = "on_take",
        already_delivered: Callable[[str, str], bool] | None = None,
        verify: bool = True,
    ) -> None:
        if ack not in ("on_take", "manual"):
            raise ValueError(f"ack must be 'on_take' or 'manual', got {ack!r}")
        self._ack_mode = ack
        self._verify = verify
        self._already_delivered = already_delivered
        if pool_bytes <= 0:
            raise ValueError(f"pool_bytes must be positive, got {pool_bytes}")
        if page_bytes is not None:
            page_bytes = _round_page(page_bytes)
            if page_bytes > pool_bytes:
                raise ValueError(f"page_bytes {page_bytes} exceeds pool_bytes {pool_bytes}")
        self._secret = secret if secret is not None else auth.load_secret()
        self.reader_id = name or f"reader-{uuid.uuid4().hex[:12]}"
        self._lsock = listen_socket(listen)
        real_host, real_port = self._lsock.getsockname()[:2]
        self.address = format_address(real_host, real_port)

        self._pool_tensor = torch.zeros(pool_bytes, dtype=torch.uint8)
        self._pool_mv = self._pool_tensor.numpy().data
        try:
            self._transport = Transport(self.reader_id)
            self._region: Region = self._transport.register(self._pool_tensor)
        except Exception:
            self._lsock.close()
            raise
        self._page_bytes = page_bytes
        self._pool: PagePool | None = None
        if page_bytes is not None:
            self._pool = PagePool(pool_bytes // page_bytes)

        self._lock = threading.RLock()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self._peers: dict[int, _Peer] = {}
        self._by_agent: dict[str, _Peer] = {}
        self._world: dict[str, int] = {}
        self._ranks: dict[tuple[str, int], _Peer] = {}
        self._pending: dict[_Key, _Pending] = {}
        self._ready: queue.Queue[_Key | None] = queue.Queue()
        # samples handed out (and acked or awaiting ``ack``): a producer that lost its
        # connection resends what it saw no ack for; those get an Ack, not a second copy
        self._delivered: collections.OrderedDict[_Key, list[_Peer]] = collections.OrderedDict()
        self._closed = False
        self._accept_paused_until = 0.0
        self._quarantine: list[tuple[float, _Key, list[int]]] = []
        self.stats: dict[str, float] = {
            "samples": 0,
            "bytes": 0,
            "refused": 0,
            "copy_s": 0.0,
            "verify_s": 0.0,
            "checksum_mismatches": 0,
            "resends_acked": 0,
        }
        self._thread = threading.Thread(target=self._run, name="hs-reader", daemon=True)
        self._thread.start()
        log.info(
            "hidden-states reader %s listening on %s, pool %.1f MiB%s",
            self.reader_id,
            self.address,
            pool_bytes / (1 << 20),
            ", handshake authenticated" if self._secret else "",
        )

    # ---------------------------------------------------------------- user side
    def get(self, timeout: float | None = None) -> Sample:
        """The next complete sample (copied out of the pool, its pages returned).
        Raises ``TimeoutError`` after ``timeout`` seconds, ``ReaderClosed`` once closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise ReaderClosed("the reader is closed")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                key = self._ready.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"no sample within {timeout} s") from None
            if key is None:
                self._ready.put(None)
                raise ReaderClosed("the reader is closed")
            sample = self._take(key)
            if sample is not None:
                return sample
            # it failed its checksum (written again, or refused) or its producer dropped it

    def __iter__(self) -> Iterator[Sample]:
        while True:
            try:
                yield self.get()
            except ReaderClosed:
                return

    def samples(self, max_samples: int | None = None, timeout: float | None = None) -> Iterator[Sample]:
        """Yield up to ``max_samples`` samples, each within ``timeout`` seconds."""
        n = 0
        while max_samples is None or n < max_samples:
            try:
                yield self.get(timeout)
            except ReaderClosed:
                return
            n += 1

    def __enter__(self) -> HiddenStatesReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving, close every connection and free the pool."""
        if self._closed:
            return
        self._closed = True
        self._ready.put(None)
        self._thread.join(timeout=10)
        with self._lock:
            for peer in list(self._peers.values()):
                peer.conn.close()
            self._peers.clear()
            self._sel.close()
            self._lsock.close()
            self._transport.close()
        log.info("hidden-states reader %s closed (%d samples)", self.reader_id, self.stats["samples"])

    def _take(self, key: _Key) -> Sample | None:
        with self._lock:
            p = self._pending.get(key)
        if p is None or not p.complete:  # discarded meanwhile
            return None
        assert p.pages is not None
        m = p.manifest
        if self._verify and not self._verified(key, p):
            return None
        t0 = time.perf_counter()
        hidden = self._assemble(m, p.pages, p.ppb)
        self.stats["copy_s"] += time.perf_counter() - t0
        sample = Sample(
            request_id=m.request_id,
            token_ids=torch.tensor(m.token_ids, dtype=torch.int64),
            hidden_states=hidden,
            layer_ids=tuple(m.layer_ids),
            producer_id=p.producer_id,
        )
        with self._lock:
            del self._pending[key]
            assert self._pool is not None
            self._pool.release(key, p.pages)
            self.stats["samples"] += 1
            self.stats["bytes"] += hidden.numel() * hidden.element_size()
            self._delivered[key] = list(p.peers.values())
            while len(self._delivered) > DELIVERED_MEMORY:
                self._delivered.popitem(last=False)
            if self._ack_mode == "on_take":
                self._ack_key(key)
            self._grant()
        return sample

    def _verified(self, key: _Key, p: _Pending) -> bool:
        """Check each rank's share against its checksum; on a mismatch ask that rank to
        write it again (or, past ``MAX_REWRITES``, refuse the sample) and return False."""
        assert p.pages is not None and self._page_bytes is not None
        m = p.manifest
        t0 = time.perf_counter()
        spans_of = spans_of_sample(m)
        bad = [
            (rank, crc)
            for rank, crc in p.checksums.items()
            if crc is not None
            and p.promised.get(rank)
            and crc
            != paged_checksum(
                self._pool_mv, p.pages, p.ppb, self._page_bytes, sorted(p.promised[rank]), spans_of
            )
        ]
        self.stats["verify_s"] += time.perf_counter() - t0
        if not bad:
            return True
        with self._lock:
            self.stats["checksum_mismatches"] += len(bad)
            p.rewrites += 1
            ranks = ", ".join(str(r) for r, _ in bad)
            if p.rewrites > MAX_REWRITES:
                why = (
                    f"request {m.request_id} of producer {key[0]} failed its checksum "
                    f"{p.rewrites} times (rank {ranks}); refusing it"
                )
                log.error("%s", why)
                if self._pending.get(key) is p:
                    for peer in p.peers.values():
                        self._send(
                            peer, protocol.Refuse(code="checksum", message=why, request_id=m.request_id)
                        )
                    p.complete = False
                    self._discard(key, p)
                return False
            log.error(
                "request %s of producer %s: rank %s's share does not match its checksum; "
                "asking for it again (%d of %d)",
                m.request_id,
                key[0],
                ranks,
                p.rewrites,
                MAX_REWRITES,
            )
            p.complete = False
            for rank, _ in bad:
                p.written.discard(rank)
                writer = p.peers.get(rank)
                if writer is not None:
                    self._send(
                        writer,
                        protocol.Rewrite(
                            request_id=m.request_id, reason="the share does not match its checksum"
                        ),
                    )
        return False

    def ack(self, sample: Sample) -> None:
        """Tell the sample's producer it is safe here (``ack="manual"``): it frees the
        sample's blocks, and will not resend it after a reconnect."""
        with self._lock:
            self._ack_key((sample.producer_id, sample.request_id))

    def _ack_key(self, key: _Key) -> None:
        for peer in self._delivered.get(key, []):
            peer.requests.discard(key[1])
            self._send(peer, protocol.Ack(request_id=key[1]))
        if key in self._delivered:
            self._delivered[key] = []  # acked: a resend of it is acked at once

    def _assemble(self, m: protocol.Manifest, pages: list[int], ppb: int) -> torch.Tensor:
        """Copy a sample out of its pages into [T, L, H] of its dtype.

        One gather over a strided view of the pool does the page lookup and the layout
        change together: one pass over the bytes and one GIL release per sample (a loop
        of per-block copies stalls on the serving thread's GIL turns).
        """
        assert self._page_bytes is not None
        pb = self._page_bytes
        dtype = getattr(torch, m.dtype)
        item = protocol.dtype_size(m.dtype)
        L, H, bs, nb = m.num_layers, m.hidden_size, m.block_size, m.num_blocks
        block_shape = (L, bs, H) if m.layout == "LTH" else (bs, L, H)
        inner = (block_shape[1] * H, H, 1)
        num_pages = self._pool_tensor.numel() // pb
        pool = self._pool_tensor[: num_pages * pb]
        idx = torch.tensor(pages, dtype=torch.int64)
        if ppb == 1:
            src, stride = pool.view(dtype), pb // item
            n_src = num_pages
        else:  # a block spans several pages: stage its pieces side by side first
            staged = pool.view(num_pages, pb).index_select(0, idx).view(-1)
            src, stride = staged.view(dtype), ppb * pb // item
            n_src, idx = nb, torch.arange(nb)
        blocks = src.as_strided((n_src, *block_shape), (stride, *inner))
        tokens_major = blocks.permute(0, 2, 1, 3) if m.layout == "LTH" else blocks
        out = empty_tensor((nb * bs, L, H), dtype)
        torch.index_select(tokens_major, 0, idx, out=out.view(nb, bs, L, H))
        return out[: m.num_tokens]

    # ------------------------------------------------------------ serving thread
    def _run(self) -> None:
        idle = 0
        while not self._closed:
            with self._lock:
                expecting = any(p.pages is not None and not p.complete for p in self._pending.values())
            # Writers need our progress to finish: poll tightly while WRITEs are due.
            timeout = 0.0 if expecting and idle < SPIN_POLLS else (POLL_S if expecting else IDLE_POLL_S)
            try:
                events = self._sel.select(timeout)
            except (OSError, ValueError):
                if self._closed:
                    return
                raise
            busy = False
            with self._lock:
                if self._closed:
                    return
                try:
                    for k, _ in events:
                        busy = True
                        if k.data is None:
                            self._accept()
                        else:
                            self._on_readable(k.data)
                    busy |= self._poll_notifs()
                    self._housekeeping()
                except Exception:  # never let one bad event stop the reader
                    log.exception("hidden-states reader: unexpected error while serving")
                    time.sleep(0.01)
            idle = 0 if busy else idle + 1

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._lsock, selectors.EVENT_READ, None)
        for peer in list(self._peers.values()):
            if peer.state != "ready" and now - peer.t_accept > HANDSHAKE_TIMEOUT_S:
                log.warning("closing %s: no handshake within %.0f s", peer.label, HANDSHAKE_TIMEOUT_S)
                self._drop(peer, "handshake timeout")
        if self._quarantine and self._quarantine[0][0] <= now:
            assert self._pool is not None
            while self._quarantine and self._quarantine[0][0] <= now:
                _, key, pages = self._quarantine.pop(0)
                self._pool.release(key, pages)
            self._grant()

    def _accept(self) -> None:
        try:
            sock, addr = self._lsock.accept()
        except BlockingIOError:
            return
        except OSError as e:  # e.g. EMFILE under a flood: pause accepting, keep serving
            log.warning("cannot accept a control connection (%s); pausing accepts for 0.2 s", e)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(self._lsock)
            self._accept_paused_until = time.monotonic() + 0.2
            return
        peer = _Peer(FramedConnection(sock), format_address(addr[0], addr[1]), sock.fileno())
        self._peers[peer.fd] = peer
        self._sel.register(sock, selectors.EVENT_READ, peer)
        peer.nonce = auth.make_nonce()
        log.debug("control connection from %s", peer.addr)

    def _on_readable(self, peer: _Peer) -> None:
        try:
            msgs = peer.conn.receive()
            for msg in msgs:
                self._handle(peer, msg)
        except ConnectionClosed:
            self._drop(peer, "connection closed")
        except ProtocolError as e:
            self.stats["refused"] += 1
            log.warning("refusing %s: %s", peer.label, e)
            self._send(peer, protocol.Refuse(code="protocol", message=str(e)))
            self._drop(peer, f"protocol error: {e}")

    def _send(self, peer: _Peer, msg: protocol._Msg) -> None:
        if peer.conn.closed:
            return
        try:
            peer.conn.send(msg)
        except OSError as e:
            log.warning("cannot send to %s: %s", peer.label, e)

    def _handle(self, peer: _Peer, msg: protocol.Message) -> None:
        if peer.state == "hello":
            if not isinstance(msg, protocol.Hello):
                raise ProtocolError(f"expected hello, got {type(msg).__name__}")
            self._on_hello(peer, msg)
        elif peer.state == "auth" and isinstance(msg, protocol.Refuse):
            log.warning("producer %s refused the handshake (%s): %s", peer.label, msg.code, msg.message)
            self._drop(peer, f"it refused the handshake: {msg.message}")
        elif peer.state == "auth":
            if not isinstance(msg, protocol.Auth):
                raise ProtocolError(f"expected auth, got {type(msg).__name__}")
            self._on_auth(peer, msg)
        elif isinstance(msg, protocol.CreditRequest):
            self._on_credit_request(peer, msg)
        elif isinstance(msg, protocol.Refuse):
            self._on_producer_refuse(peer, msg)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from a producer")

    def _on_producer_refuse(self, peer: _Peer, msg: protocol.Refuse) -> None:
        """A producer gave up on one of its samples (e.g. its WRITE kept failing): drop
        the sample, and tell its other ranks, whose shares can no longer complete it."""
        h = peer.hello
        assert h is not None
        key = (h.producer_id, msg.request_id)
        p = self._pending.get(key)
        if not msg.request_id or p is None or h.rank not in p.promised:
            log.warning("%s says: %s %s", peer.label, msg.code, msg.message)
            return
        log.error("producer %s gave up on %s (%s): %s", peer.label, msg.request_id, msg.code, msg.message)
        for rank, other in p.peers.items():
            if rank != h.rank:
                self._send(
                    other,
                    protocol.Refuse(
                        code=msg.code,
                        message=f"rank {h.rank}: {msg.message}"[:4000],
                        request_id=msg.request_id,
                    ),
                )
        p.complete = False
        self._discard(key, p)

    def _on_hello(self, peer: _Peer, h: protocol.Hello) -> None:
        known = self._world.get(h.producer_id)
        if known is not None and known != h.world_size:
            raise ProtocolError(
                f"producer {h.producer_id} said world size {known} before, now {h.world_size}"
            )
        if h.rank >= h.world_size:
            raise ProtocolError(f"rank {h.rank} outside world size {h.world_size}")
        if (h.producer_id, h.rank) in self._ranks:
            raise ProtocolError(f"producer {h.producer_id} rank {h.rank} is already connected")
        peer.hello = h
        digest = auth.proof(self._secret, "reader", h.producer_id, h.rank, h.nonce, peer.nonce)
        self._send(
            peer,
            protocol.Challenge(
                version=protocol.PROTOCOL_VERSION,
                nonce=peer.nonce,
                digest=digest,
                auth_required=self._secret is not None,
            ),
        )
        peer.state = "auth"

    def _on_auth(self, peer: _Peer, a: protocol.Auth) -> None:
        h = peer.hello
        assert h is not None
        if self._secret is not None:
            want = auth.proof(self._secret, "producer", h.producer_id, h.rank, h.nonce, peer.nonce)
            if not auth.verify(want, a.digest):
                raise ProtocolError("authentication failed: wrong shared secret")
        try:
            agent = self._transport.add_peer(a.agent_metadata)
        except TransportError as e:
            raise ProtocolError(str(e)) from None
        if agent in self._by_agent:  # a replay of a connected producer's metadata
            raise ProtocolError(f"agent {agent!r} is in use by a connected producer")
        if agent != h.agent_name:
            self._transport.remove_peer(agent)
            raise ProtocolError(f"agent name {agent!r} does not match the hello's {h.agent_name!r}")
        if self._page_bytes is None:  # only a producer that completed its handshake decides
            self._page_bytes = min(
                _round_page(h.block_bytes), self._pool_tensor.numel() // PAGE_ALIGN * PAGE_ALIGN
            )
            self._pool = PagePool(self._pool_tensor.numel() // self._page_bytes)
            log.info(
                "pool page size %d bytes (first producer's block), %d pages",
                self._page_bytes,
                self._pool.num_pages,
            )
        peer.agent = agent
        self._by_agent[agent] = peer
        self._world[h.producer_id] = h.world_size
        self._ranks[(h.producer_id, h.rank)] = peer
        peer.state = "ready"
        assert self._pool is not None
        self._send(
            peer,
            protocol.Welcome(
                reader_id=self.reader_id,
                agent_name=self._transport.name,
                agent_metadata=self._transport.metadata,
                pool_addr=self._region.addr,
                pool_bytes=self._region.nbytes,
                page_bytes=self._page_bytes,
                num_pages=self._pool.num_pages,
                mem_type="DRAM" if self._region.mem_type == "DRAM" else "VRAM",
                device_id=self._region.device_id,
            ),
        )
        log.info("producer %s connected (world size %d)", peer.label, h.world_size)

    def _on_credit_request(self, peer: _Peer, req: protocol.CreditRequest) -> None:
        h = peer.hello
        assert h is not None and self._pool is not None and self._page_bytes is not None
        m = req.manifest
        key = (h.producer_id, m.request_id)
        if key in self._delivered or (self._already_delivered is not None and self._already_delivered(*key)):
            # a resend of a sample already handed out: acknowledge, never deliver twice
            waiting = self._delivered.get(key)
            if waiting:  # handed out, its ack still awaited (manual mode): ack it then
                waiting.append(peer)
            else:
                self._send(peer, protocol.Ack(request_id=m.request_id))
            self.stats["resends_acked"] += 1
            return
        p = self._pending.get(key)
        if p is None:
            p = _Pending(manifest=m, producer_id=h.producer_id, world_size=h.world_size)
            p.ppb = pages_per_block(m.block_bytes, self._page_bytes)
            try:
                self._pool.request(key, m.num_blocks * p.ppb)
            except PoolTooSmall as e:
                self.stats["refused"] += 1
                self._send(
                    peer, protocol.Refuse(code="pool_too_small", message=str(e), request_id=m.request_id)
                )
                log.error("request %s refused: %s", m.request_id, e)
                return
            self._pending[key] = p
        elif p.manifest != m:
            raise ProtocolError(
                f"rank {h.rank} sent a manifest of {m.request_id} that differs from the first"
            )
        share = frozenset(req.blocks)
        old = p.peers.get(h.rank)
        if h.rank in p.promised:
            if old is not None and old.fd in self._peers and old is not peer:
                raise ProtocolError(f"rank {h.rank} asked twice for {m.request_id}")
            if p.promised[h.rank] != share:
                raise ProtocolError(f"rank {h.rank} changed its share of {m.request_id}")
            # the rank reconnected: it resends into the same pages
        else:
            for r, other in p.promised.items():
                if share & other:
                    raise ProtocolError(f"ranks {r} and {h.rank} both promise blocks of {m.request_id}")
            p.promised[h.rank] = share
        p.peers[h.rank] = peer
        peer.requests.add(m.request_id)
        if len(p.promised) == p.world_size:
            covered = set().union(*p.promised.values())
            if len(covered) != m.num_blocks:
                raise ProtocolError(f"the ranks' shares of {m.request_id} leave blocks unwritten")
        if p.pages is not None:
            self._send(peer, protocol.Grant(request_id=m.request_id, pages=p.pages, pages_per_block=p.ppb))
            self._maybe_complete(key, p)
        self._grant()

    def _grant(self) -> None:
        if self._pool is None:
            return
        for key, pages in self._pool.grantable():
            p = self._pending[key]  # type: ignore[index]
            p.pages = pages
            for peer in p.peers.values():
                self._send(
                    peer, protocol.Grant(request_id=p.manifest.request_id, pages=pages, pages_per_block=p.ppb)
                )
            self._maybe_complete(key, p)  # type: ignore[arg-type]

    def _maybe_complete(self, key: _Key, p: _Pending) -> None:
        if not p.complete and p.is_complete():
            p.complete = True
            self._ready.put(key)

    def _poll_notifs(self) -> bool:
        notifs = self._transport.notifications()
        for agent, data in notifs:
            peer = self._by_agent.get(agent)
            if peer is None or peer.hello is None:
                log.warning("notification from unknown agent %s ignored", agent)
                continue
            try:
                msg = protocol.decode(data)
                if not isinstance(msg, protocol.WriteDone):
                    raise ProtocolError(f"unexpected {type(msg).__name__} as a notification")
                key = (peer.hello.producer_id, msg.request_id)
                p = self._pending.get(key)
                if p is None or p.pages is None or peer.hello.rank not in p.promised:
                    raise ProtocolError(f"write_done for {msg.request_id}, which it was not granted")
                p.written.add(peer.hello.rank)
                p.checksums[peer.hello.rank] = msg.checksum
                self._maybe_complete(key, p)
            except ProtocolError as e:
                self.stats["refused"] += 1
                log.warning("bad notification from %s: %s", peer.label, e)
        return bool(notifs)

    def _drop(self, peer: _Peer, why: str) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(peer.conn.sock)
        peer.conn.close()
        self._peers.pop(peer.fd, None)
        if peer.agent and self._by_agent.get(peer.agent) is peer:
            self._await_last_notifications(peer)
        if peer.agent:
            self._by_agent.pop(peer.agent, None)
            self._transport.remove_peer(peer.agent)
        h = peer.hello
        if h is not None and self._ranks.get((h.producer_id, h.rank)) is peer:
            del self._ranks[(h.producer_id, h.rank)]
            if not any(pid == h.producer_id for pid, _ in self._ranks):
                # No rank of this producer is left: its incomplete samples can never
                # complete (a reconnecting producer resends them from scratch).
                self._world.pop(h.producer_id, None)
                for key, p in list(self._pending.items()):
                    if key[0] == h.producer_id and not p.complete:
                        self._discard(key, p)
            # Otherwise the rank may reconnect and resend its shares into the same pages.
        log.info("producer %s gone: %s", peer.label, why)

    def _await_last_notifications(self, peer: _Peer) -> None:
        """A producer that exits right after its last WRITE completed closes its control
        connection while that WRITE's notification may still be on its way (another
        channel): poll for it a little before deciding which samples are incomplete."""
        h = peer.hello
        assert h is not None

        def awaited() -> bool:
            return any(
                key[0] == h.producer_id
                and p.pages is not None
                and p.promised.get(h.rank)
                and h.rank not in p.written
                for key, p in self._pending.items()
            )

        end = time.monotonic() + LAST_NOTIFICATION_GRACE_S
        while awaited() and time.monotonic() < end:
            if not self._poll_notifs():
                time.sleep(0.001)

    def _discard(self, key: _Key, p: _Pending) -> None:
        assert self._pool is not None
        del self._pending[key]
        if p.pages is None:
            self._pool.cancel(key)
        else:
            self._quarantine.append((time.monotonic() + QUARANTINE_S, key, p.pages))
        log.warning("discarded incomplete sample %s of producer %s", key[1], key[0])
