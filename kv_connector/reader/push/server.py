"""The reader's serving thread, a thin I/O shell around its ledger: it accepts control
connections, runs the reader's side of each handshake (``handshake.ReaderHandshake``),
reads producers' messages and NIXL notifications, feeds them to the ledger
(``reader.push.ledger.ReaderLedger``), and performs what the ledger answers: messages to
send, samples to queue for the user, lines to log. A peer that breaks the protocol is
refused and dropped; nothing a peer sends can stop the thread."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kv_connector.common.device import on_device
from kv_connector.common.errors import ConfigurationError
from kv_connector.common.poller import Poller
from kv_connector.reader.pool.memory import PoolMemory
from kv_connector.reader.push.checker import ShareChecker
from kv_connector.reader.push.ledger import ReaderLedger
from kv_connector.reader.push.producers import PeerId
from kv_connector.reader.push.records import Action, CheckShare, Key, Log, Ready, Send
from kv_connector.wire import fields, protocol
from kv_connector.wire.control import ConnectionClosed, FramedConnection, OutputFull, format_address
from kv_connector.wire.handshake import HANDSHAKE_TIMEOUT_S, Phase, ReaderHandshake
from kv_connector.wire.protocol import ProtocolError
from kv_connector.wire.transport import Region, Transport, TransportError

log = logging.getLogger("kv_connector.reader.push.reader")

# pool pages are multiples of this, so any dtype can view them
PAGE_ALIGN = 64
# at most one line per this while producers wait on held leases
LEASE_LOG_S = 10.0
# deadlines (handshakes, samples, fences, departures) are looked at no oftener than this: the
# busy poll turns many times a sample, and its deadlines are seconds long
HOUSEKEEPING_S = 0.005
# or half the file descriptors the process may open, if fewer
MAX_CONNECTIONS = 1024
# connections of one host still in their handshake
MAX_UNPROVEN_PER_HOST = 32


def round_page(nbytes: int) -> int:
    if nbytes <= 0:
        raise ConfigurationError(f"page size must be positive, got {nbytes}")
    return -(-nbytes // PAGE_ALIGN) * PAGE_ALIGN


@dataclass
class _Conn:
    """One control connection."""

    id: PeerId
    conn: FramedConnection
    addr: str
    hs: ReaderHandshake
    agent: str = ""
    host: str = ""

    @property
    def label(self) -> str:
        h = self.hs.hello
        return f"{h.producer_id}/rank{h.rank}@{self.addr}" if h else self.addr


@dataclass(frozen=True)
class ServerParts:
    """What the reader hands its serving thread: the listening socket, the transport and
    the pool's registration, the ledger and the lock the user's side shares with it, the
    pool's memory, the shared secret, the reader's id, where a ready sample goes, and
    whether fingerprinted shares are values-screened on their checks' read (``ShareChecker``)."""

    listen: socket.socket
    transport: Transport
    region: Region
    ledger: ReaderLedger
    lock: threading.RLock
    pool: PoolMemory
    secret: bytes | None
    reader_id: str
    on_ready: Callable[[Key], None]
    screen: bool = False


class ReaderServer:
    """Serves the reader's connections and notifications on a thread of its own. Every
    touch of the ledger happens under ``parts.lock``, which the user's side shares."""

    def __init__(self, parts: ServerParts) -> None:
        lsock, ledger, pool = parts.listen, parts.ledger, parts.pool
        self._lsock = lsock
        self._transport = parts.transport
        self._region = parts.region
        self._ledger = ledger
        self._lock = lock = parts.lock
        self._secret = parts.secret
        self.reader_id = parts.reader_id
        self._on_ready = parts.on_ready
        self._sel = selectors.DefaultSelector()
        self._sel.register(lsock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._wake_lock = threading.Lock()
        self._released: queue.SimpleQueue[Key] = queue.SimpleQueue()
        self._checker = ShareChecker(pool, ledger, lock, self.perform, parts.screen)
        # lease ends waiting for a GPU's queued work
        self._lease_fences = pool.lease_fences
        self._device = pool.device
        self._last_lease_log = 0.0
        self._last_housekeeping = 0.0
        self._conns: dict[PeerId, _Conn] = {}
        # connected and departing producers' agents
        self._by_agent: dict[str, _Conn] = {}
        self._departing: dict[PeerId, _Conn] = {}
        self._next_id = 1
        self._accept_paused_until = 0.0
        self._closed = False
        self._writing: set[PeerId] = set()
        # bounds on what connections may hold: all of them, and those of one host that
        # have proven nothing yet (the handshake timeout closes stalled ones)
        soft_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_connections = max(8, min(MAX_CONNECTIONS, soft_fds // 2))
        self.max_unproven_per_host = MAX_UNPROVEN_PER_HOST
        self._refused_accepts = 0
        self._last_refuse_log = 0.0
        self._poller = Poller.from_env("KV_CONNECTOR_READER")
        self.thread = threading.Thread(target=self._run, name="hs-reader", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def release(self, key: Key) -> None:
        """A lease ended (any thread, a garbage collector's included): the serving thread
        returns its pages."""
        self._released.put(key)
        with self._wake_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"r")

    def close(self) -> None:
        self._closed = True
        # wake the thread
        self.release(("", ""))
        self.thread.join(timeout=10)
        self._checker.close()
        # a lease may end after the reader closed: nothing to wake then
        with self._wake_lock:
            os.close(self._wake_w)
            self._wake_w = -1
        with self._lock:
            for c in list(self._conns.values()):
                c.conn.close()
            self._conns.clear()
            self._sel.close()
            self._lsock.close()
            os.close(self._wake_r)

    # ------------------------------------------------------------- actions
    def perform(self, actions: Iterable[Action]) -> None:
        """Carry out what the ledger answered (call with the lock held)."""
        for a in actions:
            match a:
                case Send(peer=peer, msg=msg):
                    c = self._conns.get(peer)
                    if c is not None:
                        self._send(c, msg)
                case Ready(key=key):
                    self._on_ready(key)
                case CheckShare():
                    self._checker.submit(a)
                case Log(level=level, text=text):
                    getattr(log, level)("%s", text)

    def _send(self, connection: _Conn, msg: protocol.Message) -> None:
        """Queue a message without ever blocking the serving thread: a peer that stops
        reading holds only its own bounded buffer, then is dropped."""
        if connection.conn.closed:
            return
        try:
            connection.conn.send_nowait(msg)
        except OutputFull as e:
            log.warning("dropping %s: %s", connection.label, e)
            self._drop(connection, "it stopped reading")
            return
        except ConnectionClosed:
            # its reading side will report it
            return
        if connection.conn.pending_out:
            self._writing.add(connection.id)

    def _flush_writers(self) -> None:
        """Send what waits for peers whose sockets take it now; watch the others."""
        for pid in list(self._writing):
            c = self._conns.get(pid)
            if c is None or c.conn.closed:
                self._writing.discard(pid)
                continue
            try:
                done = c.conn.flush()
            except ConnectionClosed:
                self._writing.discard(pid)
                continue
            events = selectors.EVENT_READ | (0 if done else selectors.EVENT_WRITE)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.modify(c.conn.sock, events, c)
            if done:
                self._writing.discard(pid)

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        # it drives the agent holding a GPU pool's registration (UCX's CUDA IPC)
        on_device(self._device)
        while not self._closed:
            with self._lock:
                due = self._ledger.view.expecting_writes or self._ledger.view.departing
            # lease ends waiting for a GPU's queued work are looked at within the busy poll
            due = due or self._lease_fences.waiting > 0 or self._checker.waiting > 0
            # writers need our progress to finish: poll tightly while WRITEs are due
            try:
                events = self._sel.select(self._poller.timeout(due))
            except (OSError, ValueError):
                if self._closed:
                    return
                raise
            busy = False
            with self._lock:
                if self._closed:
                    return
                try:
                    for k, mask in events:
                        busy = True
                        if k.data is None:
                            self._accept()
                        elif k.data == "wake":
                            with contextlib.suppress(BlockingIOError):
                                os.read(self._wake_r, 4096)
                        elif mask & selectors.EVENT_READ:
                            self._on_readable(k.data)
                    self.take_releases()
                    busy |= self._poll_notifs()
                    self._housekeeping()
                    self._flush_writers()
                # never let one bad event stop the reader
                except Exception:
                    log.exception("hidden-states reader: unexpected error while serving")
                    time.sleep(0.01)
            self._poller.after(busy)

    def take_releases(self) -> None:
        """Return the pages of the leases that ended (call with the lock held)."""
        self._lease_fences.settle()
        # checks queued on a device pool's stream, read once done
        self._checker.settle()
        now = time.monotonic()
        while True:
            try:
                key = self._released.get_nowait()
            except queue.Empty:
                return
            self.perform(self._ledger.release(key, now))

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_housekeeping < HOUSEKEEPING_S:
            return
        self._last_housekeeping = now
        self._log_held_leases(now)
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._lsock, selectors.EVENT_READ, None)
        for c in list(self._conns.values()):
            if c.hs.expired(now):
                log.warning("closing %s: no handshake within %.0f s", c.label, HANDSHAKE_TIMEOUT_S)
                self._drop(c, "handshake timeout")
        self.perform(self._ledger.tick(now))
        self._forget_departed()

    def _log_held_leases(self, now: float) -> None:
        """Producers wait for pages while the user holds samples: say who holds them."""
        pool = self._ledger.view.pool
        if pool is None or not pool.waiting or now - self._last_lease_log < LEASE_LOG_S:
            return
        leases = self._ledger.view.leases()
        if not leases:
            return
        self._last_lease_log = now
        oldest = ", ".join(f"{s.key[1]} ({now - s.t_handed_out:.0f} s)" for s in leases[:5])
        log.warning(
            "%d samples wait for pool pages held by %d samples on lease to the user (oldest: %s): "
            "release them (sample.release(), a with block, or drop their tensors) or read with copy=True",
            pool.waiting,
            len(leases),
            oldest,
        )

    def _accept(self) -> None:
        try:
            sock, addr = self._lsock.accept()
        except BlockingIOError:
            return
        # e.g. EMFILE under a flood: pause accepting, keep serving
        except OSError as e:
            log.warning("cannot accept a control connection (%s); pausing accepts for 0.2 s", e)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(self._lsock)
            self._accept_paused_until = time.monotonic() + 0.2
            return
        host = addr[0]
        unproven = sum(1 for x in self._conns.values() if x.host == host and x.hs.phase is not Phase.READY)
        if len(self._conns) >= self.max_connections or unproven >= self.max_unproven_per_host:
            # over the bounds: this connection goes at once, the others are served
            why = (
                "too many connections"
                if len(self._conns) >= self.max_connections
                else "too many from " + host
            )
            self._refused_accepts += 1
            if time.monotonic() - self._last_refuse_log > 10.0:
                self._last_refuse_log = time.monotonic()
                log.warning("closing new control connections (%s; %d so far)", why, self._refused_accepts)
            sock.close()
            return
        c = _Conn(
            self._next_id,
            FramedConnection(sock),
            format_address(addr[0], addr[1]),
            ReaderHandshake(self._secret, time.monotonic()),
            host=host,
        )
        self._next_id += 1
        # nothing a peer does may block the serving thread
        c.conn.never_block()
        c.conn.max_frame = c.hs.frame_limit
        self._conns[c.id] = c
        self._sel.register(sock, selectors.EVENT_READ, c)
        log.debug("control connection from %s", c.addr)

    def _on_readable(self, connection: _Conn) -> None:
        try:
            connection.conn.fill()
            # one frame at a time: each is bounded by the limit of the phase it arrives in
            while not connection.conn.closed and (msg := connection.conn.receive_buffered()) is not None:
                self._handle(connection, msg)
                connection.conn.max_frame = connection.hs.frame_limit
        except ConnectionClosed:
            self._drop(connection, "connection closed")
        except ProtocolError as e:
            self._ledger.refused_peer()
            log.warning("refusing %s: %s", connection.label, e)
            self._send(connection, protocol.Refuse(code="protocol", message=fields.clip_text(str(e))))
            self._drop(connection, f"protocol error: {e}")

    def _handle(self, connection: _Conn, msg: protocol.Message) -> None:
        now = time.monotonic()
        if connection.hs.phase is Phase.HELLO:
            h = msg if isinstance(msg, protocol.Hello) else None
            known = self._ledger.view.world_of(h.producer_id) if h else None
            taken = h is not None and self._ledger.view.rank_connected(h.producer_id, h.rank)
            self._send(connection, connection.hs.on_hello(msg, known, taken))
            return
        if connection.hs.phase is Phase.AUTH:
            match msg:
                case protocol.Refuse():
                    log.warning(
                        "producer %s refused the handshake (%s): %s", connection.label, msg.code, msg.message
                    )
                    self._drop(connection, f"it refused the handshake: {msg.message}")
                case protocol.Auth():
                    self._on_auth(connection, msg, now)
                case _:
                    raise ProtocolError(f"expected auth, got {type(msg).__name__}")
            return
        match msg:
            case protocol.CreditRequest():
                self.perform(self._ledger.credit_request(connection.id, msg, now))
            case protocol.Placed():
                self.perform(self._ledger.placed(connection.id, msg, now))
            case protocol.CreditReturned():
                self.perform(self._ledger.credit_returned(connection.id, msg, now))
            case protocol.LateChecksum():
                self.perform(self._ledger.late_checksum(connection.id, msg))
            case protocol.Fenced():
                self.perform(self._ledger.fenced(connection.id, msg, now))
            case protocol.Refuse():
                self.perform(self._ledger.producer_refused(connection.id, msg, now))
            case _:
                raise ProtocolError(f"unexpected {type(msg).__name__} from a producer")

    def _on_auth(self, connection: _Conn, auth: protocol.Auth, now: float) -> None:
        connection.hs.on_auth(auth)
        h = connection.hs.hello
        assert h is not None
        old = self._by_agent.get(h.agent_name)
        # a replay of a connected producer's metadata
        if old is not None and old.id in self._conns:
            raise ProtocolError(f"agent {h.agent_name!r} is in use by a connected producer")
        # the same agent reconnecting while its departure's grace runs
        if old is not None:
            self._transport.remove_peer(h.agent_name)
            del self._by_agent[h.agent_name]
        try:
            agent = self._transport.add_peer(auth.agent_metadata)
        except TransportError as e:
            raise ProtocolError(str(e)) from None
        # another producer's metadata
        if agent in self._by_agent:
            raise ProtocolError(f"agent {agent!r} is in use by a connected producer")
        if agent != h.agent_name:
            self._transport.remove_peer(agent)
            raise ProtocolError(f"agent name {agent!r} does not match the hello's {h.agent_name!r}")
        # only a producer that completed its handshake decides
        if self._ledger.view.pool is None:
            page = min(round_page(h.block_bytes), self._region.nbytes // PAGE_ALIGN * PAGE_ALIGN)
            self._ledger.set_pages(page, self._region.nbytes // page)
            log.info(
                "pool page size %d bytes (first producer's block), %d pages",
                page,
                self._region.nbytes // page,
            )
        self._ledger.peer_ready(connection.id, h)
        if old is not None:
            self.perform(self._ledger.settle(old.id, now))
            self._departing.pop(old.id, None)
        connection.agent = agent
        self._by_agent[agent] = connection
        assert self._ledger.view.pool is not None and self._ledger.view.page_bytes is not None
        welcome = connection.hs.welcome(
            protocol.Welcome(
                reader_id=self.reader_id,
                agent_name=self._transport.name,
                agent_metadata=self._transport.metadata,
                pool_addr=self._region.addr,
                pool_bytes=self._region.nbytes,
                page_bytes=self._ledger.view.page_bytes,
                num_pages=self._ledger.view.pool.num_pages,
                mem_type=self._region.mem_type,
                device_id=self._region.device_id,
                proof=bytes(32),
            )
        )
        self._send(connection, welcome)
        # every later frame, both ways, carries the session's tag
        connection.conn.mac = connection.hs.session()
        ahead = h.credits_ahead if h.world_size == 1 else 0
        log.info(
            "producer %s connected (world size %d, %d credits ahead)", connection.label, h.world_size, ahead
        )

    def _poll_notifs(self) -> bool:
        notifs = self._transport.notifications()
        for agent, data in notifs:
            c = self._by_agent.get(agent)
            if c is None or c.hs.hello is None:
                log.warning("notification from unknown agent %s ignored", agent)
                continue
            try:
                msg = protocol.decode(data)
                if not isinstance(msg, protocol.WriteDone):
                    raise ProtocolError(f"unexpected {type(msg).__name__} as a notification")
                self.perform(self._ledger.write_done(c.id, msg, time.monotonic()))
            except ProtocolError as e:
                self._ledger.refused_peer()
                log.warning("bad notification from %s: %s", c.label, e)
        return bool(notifs)

    def _drop(self, connection: _Conn, why: str) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(connection.conn.sock)
        connection.conn.close()
        self._conns.pop(connection.id, None)
        if connection.hs.phase is Phase.READY:
            # its last notifications may still be on their way: the ledger judges its
            # samples after a grace, during which its agent stays known
            self._departing[connection.id] = connection
            self.perform(self._ledger.peer_gone(connection.id, time.monotonic()))
            self._forget_departed()
        elif connection.agent:
            self._transport.remove_peer(connection.agent)
        log.info("producer %s gone: %s", connection.label, why)

    def _forget_departed(self) -> None:
        for pid, c in list(self._departing.items()):
            if self._ledger.forgotten(pid):
                del self._departing[pid]
                if self._by_agent.get(c.agent) is c:
                    del self._by_agent[c.agent]
                    self._transport.remove_peer(c.agent)
