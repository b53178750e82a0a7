"""The sender's thread: one session after another with the reader (connect with
backoff, handshake, serve until the connection is lost, settle), feeding what the reader
says to the job ledger and doing what the ledger says: credit requests, WRITEs (through
the ``ShareWriter``), checksums (through the ``Hasher``), failures told to the reader."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_connector.cache.hasher import Hasher, computed
from kv_connector.common.device import on_device
from kv_connector.common.errors import WireError
from kv_connector.common.poller import IDLE_POLL_S
from kv_connector.sender.config import SenderConfig
from kv_connector.sender.jobs import Failure, FrozenJob, Job, log_failed
from kv_connector.sender.ledger import SendLedger
from kv_connector.sender.writer import ShareWriter
from kv_connector.wire import fields, handshake, protocol
from kv_connector.wire.control import ConnectionClosed, FramedConnection
from kv_connector.wire.failure import FailureReason
from kv_connector.wire.protocol import ProtocolError
from kv_connector.wire.transport import Region, Transport, TransportError

if TYPE_CHECKING:
    import torch

# while a shipped job waits for its step to finish on the device
HELD_POLL_S = 0.0002

log = logging.getLogger("kv_connector.sender.sender")


class SenderError(WireError):
    """The sender cannot reach or work with the reader."""


@dataclass(frozen=True)
class LoopParts:
    """What the loop works with: the agent, the job ledger and its lock, the WRITE path.

    ``checksum`` computes a job's share checksum (None: checksums off); ``inline_checksum`` says it
    is cheap enough for this thread (fingerprints of a CPU cache), with no hand-off to the
    hashing thread. ``open_gates`` releases held jobs and is True while some wait for their
    step; ``device`` is the cache's, set on the thread first.
    """

    transport: Transport
    ledger: SendLedger
    lock: threading.Lock
    writer: ShareWriter
    checksum: Callable[[Job], int] | None = None
    device: torch.device | None = None
    open_gates: Callable[[], bool] | None = None
    inline_checksum: bool = False


class SenderLoop:
    """The thread of one ``HiddenStatesSender``; every touch of the ledger is under
    ``lock``, which ``ship`` shares."""

    def __init__(
        self, config: SenderConfig, me: handshake.ProducerIdentity, secret: bytes | None, parts: LoopParts
    ) -> None:
        self.address = config.consumer_address
        self._device = parts.device
        # releases held jobs; True while some wait for their step
        self._open_gates = parts.open_gates
        # a sample was acked or refused
        self._on_outcome = config.on_outcome or (lambda: None)
        self.me = me
        self.rank = me.rank
        self.connect_timeout_s = config.connect_timeout_s
        self._secret = secret
        self._transport = parts.transport
        self._ledger = parts.ledger
        self._lock = parts.lock
        self._writer = parts.writer
        self._checksum = parts.checksum
        self.sample_timeout_s = config.sample_timeout_s
        self._next_deadline_check = 0.0
        # an inline checksum saves two wakes a sample, each a chance to hold the GIL the engine wants
        hashed_apart = parts.checksum is not None and not parts.inline_checksum
        self._hasher = Hasher(f"hs-hash-r{me.rank}", parts.device) if hashed_apart else None
        self._conn: FramedConnection | None = None
        self._handshake_conn: FramedConnection | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        # a byte waits in the pipe: another wake need not write one
        self._wake_pending = False
        self.closed = False
        # why the thread died, if it did: it never ships again (``ship`` fails fast)
        self.dead: str | None = None
        self.connected = threading.Event()
        # None while connected, else why not (read by the worker's reports)
        self.link_error: str | None = "not connected yet"
        # sleep mode (``pause``): why the thread must hold no connection, None when it may
        self._pause: str | None = None
        self._resumed = threading.Event()
        # set while paused, connection and peer gone
        self.parked = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"hs-sender-r{me.rank}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        """Wake the thread; one byte stands for every wake until the thread reads it."""
        if self._wake_pending:
            return
        self._wake_pending = True
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def pause(self, why: str, timeout: float) -> bool:
        """Leave the reader (WRITEs in flight settle first) and hold no connection until
        ``resume``; ``link_error`` says ``why``. The caller fails the jobs first. False if
        the thread did not park within ``timeout`` seconds (the engine sleeps)."""
        self._resumed.clear()
        self._pause = why
        self.wake()
        hs = self._handshake_conn
        if hs is not None:
            # abort a handshake in progress
            hs.close()
        if self.dead is not None or not self.thread.is_alive():
            return True
        return self.parked.wait(timeout)

    def resume(self) -> None:
        """Connect again (a new handshake: the reader loads this agent's metadata afresh)."""
        self._pause = None
        self._resumed.set()
        self.wake()

    def hasher_idle(self, timeout: float) -> bool:
        """Wait until no checksum is being computed (none reads the cache after this)."""
        try:
            return self._hasher is None or self._hasher.submit(lambda: 0).result(timeout) == 0
        except concurrent.futures.TimeoutError:
            return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.wake()
        hs = self._handshake_conn
        if hs is not None:
            # abort a handshake in progress
            hs.close()
        self.thread.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        if self._hasher is not None:
            self._hasher.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---------------------------------------------------------- sender thread
    def _run(self) -> None:
        """The thread: sessions until closed. A bug (any exception not a peer's fault)
        ends it visibly: the link error names it, ``connected`` is clear, ``ship`` fails
        fast and what it held failed; the scheduler stops admitting requests to it after
        ``connect_timeout_s``, as for a reader it cannot reach."""
        try:
            # it drives the NIXL agent that holds the cache's registration
            on_device(self._device)
            self._sessions()
        except Exception as e:
            log.exception("rank %d sender thread failed; this rank ships nothing more", self.rank)
            why = f"the sender thread failed: {type(e).__name__}: {e}"
            self.dead = self.link_error = why
            self.connected.clear()
            self._fail_all(why)

    def _sessions(self) -> None:
        """Connect (retrying), serve until the connection is lost, reset what was not
        acknowledged, and connect again. A request fails only when it waited
        ``connect_timeout_s`` without a reader, the reader refused it, or its deadline
        (``sample_timeout_s`` after its grant) passed."""
        last_error = ""
        while not self.closed:
            if self._pause is not None:
                self._park()
                continue
            try:
                self._connect()
            # closed (or paused) while connecting
            except SenderError as e:
                if self._pause is not None:
                    continue
                last_error = str(e)
                break
            try:
                self._serve()
                if self._pause is None:
                    # closed
                    return
                self._leave(self._pause)
            except (ConnectionClosed, ProtocolError, OSError, TransportError) as e:
                last_error = str(e)
                self._on_lost(e)
        if last_error:
            self._fail_all(f"sender closed: {last_error}")

    def _serve(self) -> None:
        assert self._conn is not None
        sel = selectors.DefaultSelector()
        sel.register(self._conn.sock, selectors.EVENT_READ, "conn")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        # jobs wait for their step on the device: look again soon
        held = False
        try:
            while not self.closed and self._pause is None:
                # WRITEs are the writer thread's; this one waits for the reader's messages and work
                for key, _ in sel.select(HELD_POLL_S if held else IDLE_POLL_S):
                    if key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        # after the read: a later wake writes again
                        self._wake_pending = False
                    else:
                        for msg in self._conn.receive():
                            self._handle(msg)
                held = self._open_gates is not None and self._open_gates()
                self.send_requests()
                self._send_checksums()
                self._check_deadlines()
            self._give_back_credits()
        finally:
            sel.close()

    def _give_back_credits(self) -> None:
        """Leaving (closed or paused): the credits held unused go back, so that the reader
        frees them now rather than after the quarantine of a lost connection."""
        with self._lock:
            back = self._ledger.give_back_credits()
        with contextlib.suppress(OSError, ConnectionClosed):
            for g in back:
                assert self._conn is not None
                self._conn.send(protocol.CreditReturned(generation=g))

    def _leave(self, why: str) -> None:
        """Paused while connected: settle the WRITEs in flight, forget the reader."""
        self._disconnect(why)
        log.info("rank %d left the reader at %s: %s", self.rank, self.address, why)

    def _disconnect(self, why: str) -> int:
        """Let the WRITEs in flight settle, fail the jobs that cannot be resent, close the
        connection and forget the reader; returns how many requests will be resent."""
        self._writer.settle()
        with self._lock:
            resend, failures = self._ledger.connection_lost(time.monotonic())
        log_failed(*failures)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.connected.clear()
        self.link_error = why
        return resend

    def _park(self) -> None:
        why = self._pause
        if why is None:
            return
        self.link_error = why
        self.parked.set()
        while not self.closed and self._pause is not None:
            self._resumed.wait(0.05)
        self.parked.clear()

    def _on_lost(self, error: BaseException) -> None:
        """The connection broke: let WRITEs in flight settle, forget the reader, and mark
        every unacknowledged request for resending after reconnecting."""
        resend = self._disconnect(f"lost the connection: {error}")
        # a reader that keeps breaking the protocol must not keep jobs forever
        self._expire(str(error))
        where = self.address
        if resend:
            log.warning(
                "rank %d lost the reader at %s (%s); %d unacknowledged requests will be resent",
                self.rank,
                where,
                error,
                resend,
            )
        else:
            log.info("rank %d: the reader at %s closed the connection", self.rank, where)

    def _connect(self) -> None:
        """Connect, retrying with backoff while not closed; requests that waited longer
        than ``connect_timeout_s`` for a reader fail meanwhile."""
        delay = 0.1
        first = self.link_error == "not connected yet"
        while True:
            if self.closed or self._pause is not None:
                raise SenderError("closed" if self.closed else "paused")
            try:
                self._handshake()
                self.link_error = None
                if not first:
                    with self._lock:
                        self._ledger.reconnected()
                self.connected.set()
                return
            except (
                OSError,
                TimeoutError,
                ConnectionClosed,
                handshake.HandshakeError,
                ProtocolError,
                TransportError,
            ) as e:
                why = str(e) or type(e).__name__
            self.link_error = why
            self._expire(why)
            log.warning(
                "rank %d: reader at %s not reachable (%s); retrying in %.1f s",
                self.rank,
                self.address,
                why,
                delay,
            )
            end = time.monotonic() + delay
            while time.monotonic() < end and not self.closed and self._pause is None:
                time.sleep(min(0.05, delay))
                self._expire(why)
            delay = min(delay * 2, 2.0)

    def _expire(self, why: str) -> None:
        with self._lock:
            late = self._ledger.expire(time.monotonic(), why, self.address)
        log_failed(*late)

    def _handshake(self) -> None:
        budget = min(handshake.HANDSHAKE_TIMEOUT_S, max(self.connect_timeout_s, 1.0))
        conn = FramedConnection.connect(self.address, timeout=budget)
        self._handshake_conn = conn
        try:
            w = handshake.as_producer(conn, self.me, self._secret, self._transport.metadata, budget)
            peer = self._transport.add_peer(w.agent_metadata)
            self._writer.connect(
                peer, Region(w.pool_addr, w.pool_bytes, w.mem_type, w.device_id), w.page_bytes
            )
            self.attach(conn)
            log.info(
                "rank %d connected to reader %s at %s (pages of %d bytes)",
                self.rank,
                w.reader_id,
                self.address,
                w.page_bytes,
            )
        except BaseException:
            conn.close()
            raise
        finally:
            self._handshake_conn = None

    def attach(self, conn: FramedConnection) -> None:
        """The connection to the reader from here on (the handshake's)."""
        self._conn = conn

    # ------------------------------------------------------------- messages
    def _handle(self, msg: protocol.Message) -> None:
        now = time.monotonic()
        match msg:
            case protocol.Grant():
                with self._lock:
                    self._ledger.on_grant(msg, self._writer.page_bytes, self._writer.pool_bytes, now)
                self._writer.wake()
            case protocol.Credit():
                with self._lock:
                    self._ledger.on_credit(msg, self._writer.page_bytes, self._writer.pool_bytes)
            case protocol.CreditRecall():
                with self._lock:
                    back = self._ledger.on_recall(msg.generation)
                if back:
                    assert self._conn is not None
                    self._conn.send(protocol.CreditReturned(generation=msg.generation))
            case protocol.Rewrite():
                try:
                    with self._lock:
                        again = self._ledger.on_rewrite(msg)
                except FrozenJob:
                    with self._lock:
                        failure = self._ledger.fail(
                            msg.request_id,
                            "the reader asks to write it again, but it was preempted: its blocks are reused",
                            FailureReason.PREEMPTED,
                            code="preempted",
                        )
                    if failure is not None:
                        log_failed(failure)
                        self.tell_reader(failure)
                    return
                if again:
                    log.warning(
                        "rank %d: the reader asks to write %s again: %s",
                        self.rank,
                        msg.request_id,
                        msg.reason,
                    )
                self._writer.wake()
            case protocol.Ack():
                with self._lock:
                    known = self._ledger.on_ack(msg.request_id, now)
                if not known:
                    log.warning("ack for %s, which is not in flight; ignored", msg.request_id)
                self._on_outcome()
            case protocol.Refuse():
                with self._lock:
                    refused = self._ledger.on_refuse(msg)
                if refused is None:
                    rid = msg.request_id
                    log.info("rank %d: the reader refused %s, which ended here already", self.rank, rid)
                else:
                    log_failed(refused)
                    # its WRITE in flight settles, then its fence (S9)
                    self.tell_reader(refused)
                self._on_outcome()
            case _:
                raise ProtocolError(f"unexpected {type(msg).__name__} from the reader")

    def send_requests(self) -> bool:
        """The loop's sending step. Every job that has no pages on this connection: a new
        one placed in a credit held ahead (``Placed``; its WRITE is due at once), else a
        credit request (new ones, and after a reconnect all that were not acknowledged),
        oldest first; its checksum is computed meanwhile, once (a placed job's before its
        WRITE, where this thread computes it)."""
        assert self._conn is not None
        with self._lock:
            placed, returned = self._ledger.place_due(time.monotonic(), self._writer.page_bytes)
            due = self._ledger.requests_due()
            to_hash = self._ledger.checksums_due() if self._checksum is not None else []
        try:
            for g in returned:
                self._conn.send(protocol.CreditReturned(generation=g))
            for job in placed:
                assert job.grant is not None
                g = job.grant.generation
                self._conn.send(protocol.Placed(manifest=job.manifest, blocks=list(job.share), generation=g))
            for job in due:
                self._conn.send(protocol.CreditRequest(manifest=job.manifest, blocks=list(job.share)))
        # failures of these jobs meanwhile were parked: told after their message (S11)
        finally:
            if placed or due:
                with self._lock:
                    parked = self._ledger.announced(j.request_id for j in placed + due)
                for f in parked:
                    self.tell_reader(f)
        self._hash(to_hash)
        if placed:
            self._writer.wake()
        return bool(due or placed)

    def _hash(self, to_hash: list[Job]) -> None:
        """Each job's checksum: on this thread where it is cheap, else on the hashing thread."""
        # hashed while the reader grants pages
        for job in to_hash:
            assert self._checksum is not None
            if self._hasher is None:
                value = computed(functools.partial(self._checksum, job))
                self._checksum_done(job.request_id, value, wake=False)
                continue
            fut = self._hasher.submit(functools.partial(self._checksum, job))
            fut.add_done_callback(functools.partial(self._checksum_done, job.request_id))

    def _send_checksums(self) -> bool:
        """A ``LateChecksum`` for every WRITE that went out before its checksum was ready."""
        assert self._conn is not None
        with self._lock:
            owed = self._ledger.checksums_owed()
        for job in owed:
            assert job.checksum is not None
            self._conn.send(protocol.LateChecksum(request_id=job.request_id, checksum=job.checksum))
        return bool(owed)

    def _checksum_done(self, request_id: str, fut: concurrent.futures.Future[int], wake: bool = True) -> None:
        """On the hashing thread (``wake``: then this one is woken) or this one: hand the
        checksum (or why not) to the ledger."""
        failure: Failure | None = None
        try:
            value = fut.result()
        except Exception as e:
            with self._lock:
                failure = self._ledger.checksum_failed(request_id, f"{type(e).__name__}: {e}")
        else:
            with self._lock:
                self._ledger.checksum_ready(request_id, value)
        if failure is not None:
            log_failed(failure)
            self.tell_reader(failure)
        if wake:
            self.wake()

    def _check_deadlines(self) -> None:
        """Twice a second: fail the jobs granted more than ``sample_timeout_s`` ago and
        still not acknowledged (S7), and tell the reader."""
        now = time.monotonic()
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + 0.5
        with self._lock:
            late = self._ledger.expire_granted(now, self.sample_timeout_s)
        log_failed(*late)
        for f in late:
            self.tell_reader(f)

    def tell_reader(self, failure: Failure) -> None:
        """A granted request failed: the reader drops its sample (the other ranks' shares
        included: it can never complete). A WRITE still in flight is polled to its end;
        once none is, the grant is fenced (S9). A job whose CreditRequest or Placed this
        thread is about to send is told after it (S11)."""
        with self._lock:
            if self._ledger.park(failure):
                return
        conn = self._conn
        if conn is not None and failure.tell_reader:
            with contextlib.suppress(OSError):
                conn.send(
                    protocol.Refuse(
                        code=failure.code,
                        message=fields.clip_text(failure.why),
                        request_id=failure.request_id,
                    )
                )
        fence = None
        if failure.generation is not None:
            msg = protocol.Fenced(request_id=failure.request_id, generation=failure.generation)
            fence = functools.partial(self._fence, conn, msg)
        if failure.xfer is not None:
            self._writer.adopt(failure.xfer, fence)
        elif fence is not None:
            fence()

    def _fence(self, conn: FramedConnection | None, msg: protocol.Fenced) -> None:
        """No WRITE of a failed job is in flight: its grant's pages are the reader's again
        (on the connection that granted them; a later one never knew them)."""
        if conn is not None and conn is self._conn:
            with contextlib.suppress(OSError, ConnectionClosed):
                conn.send(msg)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            failures = self._ledger.fail_all(why)
        log_failed(*failures)

