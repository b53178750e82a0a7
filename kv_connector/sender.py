"""HiddenStatesSender: the producer side of one rank. Asks the reader for pages, WRITEs a
request's cache blocks into them over NIXL, and reports the request finished once the
reader acknowledged it (so its blocks may be freed)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import queue
import selectors
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_connector import auth, protocol
from kv_connector.control import ConnectionClosed, FramedConnection
from kv_connector.integrity import block_checksum, spans_of_sample
from kv_connector.layout import BlockLayout, piece_spans, stripe
from kv_connector.protocol import ProtocolError
from kv_connector.transport import Region, Transfer, Transport, TransportError

log = logging.getLogger(__name__)

# Sender-thread polling while a WRITE is in flight (UCX moves the bytes inside these
# polls): SPIN_POLLS polls without sleeping after each event, then one every POLL_S.
SPIN_POLLS = int(os.environ.get("KV_CONNECTOR_SENDER_SPIN_POLLS", "20"))
HANDSHAKE_TIMEOUT_S = 10.0  # one connection attempt, all handshake messages included
POLL_S = float(os.environ.get("KV_CONNECTOR_SENDER_POLL_S", "0.0002"))
IDLE_POLL_S = 0.05
WRITE_ATTEMPTS = 3  # a WRITE that fails in NIXL is posted again this many times in all
WRITE_RETRY_S = 0.2  # backoff before posting again (a gone reader's EOF arrives first)


@dataclass(frozen=True)
class SenderConfig:
    """Where and as whom a rank ships.

    consumer_address: the reader's control address, ``HOST:PORT``.
    producer_id: shared by all ranks of one producer engine, unique among producers.
    rank / world_size: this rank and how many ranks share each sample's blocks.
    connect_timeout_s: how long to keep trying to reach the reader.
    checksum: send the XXH3-64 of each share with its WRITE, for the reader to check
    (on a GPU cache this stages the share's bytes to host memory once).
    """

    consumer_address: str
    producer_id: str
    rank: int = 0
    world_size: int = 1
    connect_timeout_s: float = 60.0
    checksum: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if self.connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be positive")


@dataclass
class _Job:
    request_id: str
    manifest: protocol.Manifest
    block_ids: list[int]
    share: range
    xfer: Transfer | None = None
    t_write: float = 0.0
    requested: bool = False  # a credit request went out on the current connection
    t_wait: float = field(default_factory=time.monotonic)  # since when it waits for a reader
    grant: protocol.Grant | None = None  # the pages on the current connection
    written: bool = False
    checksum: concurrent.futures.Future[int] | None = None
    attempts: int = 0  # WRITEs of this share that failed in NIXL, on this connection
    retry_at: float = 0.0
    t_submit: float = field(default_factory=time.monotonic)


class _Hasher:
    """One thread computing checksums in submission order. Not a ThreadPoolExecutor:
    those refuse work once the interpreter starts exiting, which is exactly when a
    worker's shutdown drains its last samples."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], int], concurrent.futures.Future[int]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], int]) -> concurrent.futures.Future[int]:
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fn, fut = item
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)
            # hold no reference to the sender between jobs: it must be collectable (and
            # its NIXL agent destroyed) before the interpreter finalizes
            del item, fn, fut

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


class SenderError(RuntimeError):
    """The sender cannot reach or work with the reader."""


class HiddenStatesSender:
    """Ships one rank's share of each request's hidden-state blocks.

    ``cache``: the cache-only layer's tensor, [num_blocks, ...] in ``layout``; registered
    with NIXL once, never copied. ``ship`` is thread-safe and returns at once; the
    ``take_finished`` / ``take_failed`` results come from a background thread.
    """

    def __init__(
        self,
        config: SenderConfig,
        cache: torch.Tensor,
        layout: BlockLayout,
        layer_ids: Sequence[int],
        secret: bytes | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.layer_ids = list(layer_ids)
        if len(self.layer_ids) != layout.num_layers:
            raise ValueError(f"{len(self.layer_ids)} layer ids for {layout.num_layers} layers")
        block_stride = cache.stride(0) * cache.element_size()
        nbytes = cache.numel() * cache.element_size()
        if block_stride != layout.block_bytes or nbytes != cache.shape[0] * layout.block_bytes:
            raise ValueError(
                f"cache tensor blocks are {block_stride} bytes apart and it holds {nbytes} "
                f"bytes; the layout says blocks of {layout.block_bytes}"
            )
        self.num_cache_blocks = cache.shape[0]
        # the cache's bytes as one flat uint8 tensor (blocks are dense from data_ptr)
        self._raw = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
            cache.untyped_storage(), cache.storage_offset() * cache.element_size(), (nbytes,), (1,)
        )
        self._raw_mv = None if self._raw.is_cuda else self._raw.numpy().data
        self._hasher = _Hasher(f"hs-hash-r{config.rank}") if config.checksum else None
        self._secret = secret if secret is not None else auth.load_secret()
        self.agent_name = f"{config.producer_id}-r{config.rank}-{os.getpid()}"
        self._transport = Transport(self.agent_name)
        self._local: Region = self._transport.register(cache)
        self._remote: Region | None = None
        self._page_bytes = 0
        self._reader_agent = ""
        self._conn: FramedConnection | None = None
        self._handshake_conn: FramedConnection | None = None

        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._jobs: dict[str, _Job] = {}
        self._finished: set[str] = set()
        self._failed: dict[str, str] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self.connected = threading.Event()
        # None while connected, else why not (read by the worker's reports)
        self.link_error: str | None = "not connected yet"
        self.stats: dict[str, float] = {
            "requests": 0,
            "bytes": 0,
            "grant_wait_s": 0.0,
            "write_s": 0.0,
            "ack_wait_s": 0.0,
            "checksum_s": 0.0,
            "rewrites": 0,
            "write_retries": 0,
        }
        self._thread = threading.Thread(target=self._run, name=f"hs-sender-r{config.rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- caller side
    def ship(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """Queue a request: ``token_ids`` are its tokens, ``block_ids`` the cache blocks
        holding them in block-table order (block j holds tokens j*block_size...)."""
        bs = self.layout.block_size
        n_blocks = -(-len(token_ids) // bs)
        if len(block_ids) < n_blocks:
            raise ValueError(
                f"{request_id}: {len(token_ids)} tokens need {n_blocks} blocks, got {len(block_ids)}"
            )
        blocks = [int(b) for b in block_ids[:n_blocks]]
        for b in blocks:
            if not 0 <= b < self.num_cache_blocks:
                raise ValueError(f"{request_id}: block id {b} outside the cache's {self.num_cache_blocks}")
        manifest = protocol.Manifest(
            request_id=request_id,
            token_ids=[int(t) for t in token_ids],
            layer_ids=self.layer_ids,
            hidden_size=self.layout.hidden_size,
            dtype=self.layout.dtype,
            layout=self.layout.layout,
            block_size=bs,
            num_blocks=n_blocks,
            block_bytes=self.layout.block_bytes,
        )
        protocol.check_manifest(manifest)
        share = stripe(n_blocks, self.config.rank, self.config.world_size)
        job = _Job(request_id, manifest, blocks, share)
        with self._lock:
            if request_id in self._jobs:
                raise ValueError(f"{request_id} is already being shipped")
            self._jobs[request_id] = job
        self._inbox.put(job)
        self._wake()

    def take_finished(self) -> set[str]:
        """Request ids the reader acknowledged since the last call."""
        with self._lock:
            out, self._finished = self._finished, set()
        return out

    def take_failed(self) -> dict[str, str]:
        """Request ids that failed since the last call, with the reason."""
        with self._lock:
            out, self._failed = self._failed, {}
        return out

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._jobs)

    @property
    def unwritten(self) -> int:
        """Requests whose blocks have not all landed in the reader yet."""
        with self._lock:
            return sum(not j.written for j in self._jobs.values())

    def count_unwritten(self, request_ids: Sequence[str]) -> int:
        """How many of ``request_ids`` still have a WRITE to make (in flight, waiting for
        pages, or not started)."""
        with self._lock:
            return sum(1 for r in request_ids if r in self._jobs and not self._jobs[r].written)

    def wait_written(self, request_ids: Sequence[str], timeout: float) -> bool:
        """Block until none of ``request_ids`` has a WRITE pending (landed, failed or
        unknown); False if ``timeout`` seconds passed first."""
        want = set(request_ids)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = {r for r in want if r in self._jobs and not self._jobs[r].written}
            if not pending:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        hs = self._handshake_conn
        if hs is not None:
            hs.close()  # abort a handshake in progress
        self._thread.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._transport.close()
        if self._hasher is not None:
            self._hasher.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    # ---------------------------------------------------------- sender thread
    def _run(self) -> None:
        """Sessions: connect (retrying), serve until the connection is lost, reset what
        was not acknowledged, and connect again. A request fails only when it waited
        ``connect_timeout_s`` without a reader, or the reader refused it."""
        last_error = ""
        while not self._closed:
            try:
                self._connect()
            except SenderError as e:  # closed while connecting
                last_error = str(e)
                break
            try:
                self._serve()
                return  # closed
            except (ConnectionClosed, ProtocolError, OSError, TransportError) as e:
                last_error = str(e)
                self._on_lost(e)
            except Exception as e:
                log.exception("rank %d sender thread failed", self.config.rank)
                self._fail_all(f"sender failed: {type(e).__name__}: {e}")
                return
        if last_error:
            self._fail_all(f"sender closed: {last_error}")

    def _serve(self) -> None:
        assert self._conn is not None
        sel = selectors.DefaultSelector()
        sel.register(self._conn.sock, selectors.EVENT_READ, "conn")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        idle = 0
        try:
            while not self._closed:
                with self._lock:
                    writing = any(j.xfer is not None for j in self._jobs.values())
                timeout = 0.0 if writing and idle < SPIN_POLLS else (POLL_S if writing else IDLE_POLL_S)
                busy = False
                for key, _ in sel.select(timeout):
                    busy = True
                    if key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                    else:
                        for msg in self._conn.receive():
                            self._handle(msg)
                busy |= self._submit_new()
                busy |= self._start_writes()
                busy |= self._poll_writes()
                idle = 0 if busy else idle + 1
        finally:
            sel.close()

    def _on_lost(self, e: BaseException) -> None:
        """The connection broke: let WRITEs in flight finish or fail, forget the reader,
        and mark every unacknowledged request for resending after reconnecting."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            deadline = time.monotonic() + 5.0
            while job.xfer is not None and time.monotonic() < deadline:
                try:
                    if self._transport.poll(job.xfer):
                        job.xfer = None
                except TransportError:
                    job.xfer = None
            job.xfer = job.grant = None
            job.requested = job.written = False
            job.attempts = 0
        if self._reader_agent:
            self._transport.remove_peer(self._reader_agent)
            self._reader_agent = ""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.connected.clear()
        self.link_error = f"lost the connection: {e}"
        self._expire(str(e))  # a reader that keeps breaking the protocol must not keep jobs forever
        if jobs:
            log.warning(
                "rank %d lost the reader at %s (%s); %d unacknowledged requests will be resent",
                self.config.rank,
                self.config.consumer_address,
                e,
                len(jobs),
            )
        else:
            log.info(
                "rank %d: the reader at %s closed the connection",
                self.config.rank,
                self.config.consumer_address,
            )

    def _connect(self) -> None:
        """Connect, retrying with backoff while not closed; requests that waited longer
        than ``connect_timeout_s`` for a reader fail meanwhile."""
        cfg = self.config
        delay = 0.1
        while True:
            if self._closed:
                raise SenderError("closed")
            try:
                self._handshake()
                self.link_error = None
                self.connected.set()
                return
            except (OSError, TimeoutError, ConnectionClosed, SenderError, ProtocolError, TransportError) as e:
                why = str(e) or type(e).__name__
            self.link_error = why
            self._expire(why)
            log.warning(
                "rank %d: reader at %s not reachable (%s); retrying in %.1f s",
                cfg.rank,
                cfg.consumer_address,
                why,
                delay,
            )
            end = time.monotonic() + delay
            while time.monotonic() < end and not self._closed:
                time.sleep(min(0.05, delay))
                self._expire(why)
            delay = min(delay * 2, 2.0)

    def _expire(self, why: str) -> None:
        now = time.monotonic()
        limit = self.config.connect_timeout_s
        with self._lock:
            late = [j for j in self._jobs.values() if now - j.t_wait > limit]
            for j in late:
                del self._jobs[j.request_id]
        for j in late:
            self._record_failure(
                j.request_id,
                f"cannot reach the reader at {self.config.consumer_address} for {limit:.0f} s "
                f"(last error: {why})",
            )

    def _handshake(self) -> None:
        cfg = self.config
        budget = min(HANDSHAKE_TIMEOUT_S, max(cfg.connect_timeout_s, 1.0))
        deadline = time.monotonic() + budget
        conn = FramedConnection.connect(cfg.consumer_address, timeout=budget)
        self._handshake_conn = conn
        try:
            nonce = auth.make_nonce()
            conn.send(
                protocol.Hello(
                    version=protocol.PROTOCOL_VERSION,
                    producer_id=cfg.producer_id,
                    rank=cfg.rank,
                    world_size=cfg.world_size,
                    agent_name=self.agent_name,
                    block_bytes=self.layout.block_bytes,
                    nonce=nonce,
                )
            )
            ch = conn.receive_one(max(0.0, deadline - time.monotonic()))
            if isinstance(ch, protocol.Refuse):
                raise SenderError(f"reader refused: {ch.message}")
            if not isinstance(ch, protocol.Challenge):
                raise SenderError(f"expected a challenge, got {type(ch).__name__}")
            if ch.auth_required and self._secret is None:
                self._refuse(conn, "the producer has no shared secret (KV_CONNECTOR_SECRET)")
                raise SenderError("the reader requires a shared secret; set KV_CONNECTOR_SECRET")
            if self._secret is not None:
                want = auth.proof(self._secret, "reader", cfg.producer_id, cfg.rank, nonce, ch.nonce)
                if not auth.verify(want, ch.digest):
                    self._refuse(conn, "the reader's proof does not match the producer's shared secret")
                    raise SenderError("the reader failed authentication (wrong or no shared secret)")
            digest = auth.proof(self._secret, "producer", cfg.producer_id, cfg.rank, nonce, ch.nonce)
            conn.send(protocol.Auth(digest=digest, agent_metadata=self._transport.metadata))
            w = conn.receive_one(max(0.0, deadline - time.monotonic()))
            if isinstance(w, protocol.Refuse):
                raise SenderError(f"reader refused: {w.message}")
            if not isinstance(w, protocol.Welcome):
                raise SenderError(f"expected welcome, got {type(w).__name__}")
            self._reader_agent = self._transport.add_peer(w.agent_metadata)
            self._remote = Region(w.pool_addr, w.pool_bytes, w.mem_type, w.device_id)
            self._page_bytes = w.page_bytes
            self._conn = conn
            log.info(
                "rank %d connected to reader %s at %s (pages of %d bytes)",
                cfg.rank,
                w.reader_id,
                cfg.consumer_address,
                w.page_bytes,
            )
        except BaseException:
            conn.close()
            raise
        finally:
            self._handshake_conn = None

    @staticmethod
    def _refuse(conn: FramedConnection, why: str) -> None:
        """Tell the reader why this producer turns away (it logs it), then go."""
        with contextlib.suppress(OSError):
            conn.send(protocol.Refuse(code="auth", message=why))

    def _submit_new(self) -> bool:
        """Send a credit request for every job that has none on this connection (new
        ones, and after a reconnect all that were not acknowledged), oldest first."""
        assert self._conn is not None
        while True:
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                break
        with self._lock:
            todo = [j for j in self._jobs.values() if not j.requested]
        for job in todo:
            job.requested = True
            self._conn.send(protocol.CreditRequest(manifest=job.manifest, blocks=list(job.share)))
            if self._hasher is not None and job.checksum is None and job.share:
                # hashed while the reader grants pages; kept across resends
                job.checksum = self._hasher.submit(functools.partial(self._share_checksum, job))
                job.checksum.add_done_callback(lambda _: self._wake())
        return bool(todo)

    def _share_checksum(self, job: _Job) -> int:
        """XXH3-64 of this rank's share of the sample's bytes, read from the cache."""
        t0 = time.perf_counter()
        m = job.manifest
        spans_of = spans_of_sample(m)
        if self._raw_mv is not None:
            crc = block_checksum(
                self._raw_mv, ((j, job.block_ids[j] * m.block_bytes) for j in job.share), spans_of
            )
        else:  # GPU cache: stage the share's blocks to host once
            idx = torch.tensor([job.block_ids[j] for j in job.share], device=self._raw.device)
            host = self._raw.view(-1, m.block_bytes).index_select(0, idx).cpu().view(-1)
            offsets = ((j, i * m.block_bytes) for i, j in enumerate(job.share))
            crc = block_checksum(host.numpy().data, offsets, spans_of)
        self.stats["checksum_s"] += time.perf_counter() - t0
        return crc

    def _handle(self, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Grant):
            job = self._jobs.get(msg.request_id)
            if job is None or job.grant is not None:
                raise ProtocolError(f"grant for {msg.request_id}, which is not waiting")
            self._check_grant(job, msg)
            job.grant = msg
            self.stats["grant_wait_s"] += time.monotonic() - job.t_submit
            self._start_writes()
            self._reader_works()
        elif isinstance(msg, protocol.Rewrite):
            job = self._jobs.get(msg.request_id)
            if job is None or job.grant is None or not job.share:
                raise ProtocolError(f"rewrite of {msg.request_id}, which it was not granted")
            if job.written:  # else its WRITE is still in flight or due: it will land anyway
                log.warning(
                    "rank %d: the reader asks to write %s again: %s",
                    self.config.rank,
                    msg.request_id,
                    msg.reason,
                )
                job.written = False
                self.stats["rewrites"] += 1
            self._start_writes()
        elif isinstance(msg, protocol.Ack):
            job = self._jobs.get(msg.request_id)
            if job is None:
                log.warning("ack for %s, which is not in flight; ignored", msg.request_id)
                return
            with self._lock:
                del self._jobs[msg.request_id]
                self._finished.add(msg.request_id)
            self._reader_works()
            self.stats["requests"] += 1
            self.stats["ack_wait_s"] += time.monotonic() - job.t_write
        elif isinstance(msg, protocol.Refuse):
            if msg.request_id and msg.request_id in self._jobs:
                with self._lock:
                    del self._jobs[msg.request_id]
                self._record_failure(msg.request_id, f"reader refused ({msg.code}): {msg.message}")
            else:
                raise ProtocolError(f"reader refused the connection ({msg.code}): {msg.message}")
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from the reader")

    def _reader_works(self) -> None:
        """The reader answered correctly: no job is waiting for a working reader (one
        held back by credits is waiting for the trainer, which is not a fault)."""
        now = time.monotonic()
        with self._lock:
            for j in self._jobs.values():
                j.t_wait = now

    def _check_grant(self, job: _Job, grant: protocol.Grant) -> None:
        m = job.manifest
        ppb = len(piece_spans(m.block_bytes, self._page_bytes))
        if grant.pages_per_block != ppb or len(grant.pages) != m.num_blocks * ppb:
            raise ProtocolError(f"grant of {len(grant.pages)} pages does not fit {m.request_id}")
        assert self._remote is not None
        if max(grant.pages) * self._page_bytes + self._page_bytes > self._remote.nbytes:
            raise ProtocolError(f"grant for {m.request_id} names pages outside the reader's pool")

    def _start_writes(self) -> bool:
        """Post the WRITE of every granted share whose checksum is ready (and whose
        retry backoff, after a failed WRITE, is over)."""
        now = time.monotonic()
        with self._lock:
            due = [
                j
                for j in self._jobs.values()
                if j.grant is not None
                and j.xfer is None
                and not j.written
                and (j.checksum is None or j.checksum.done())
                and now >= j.retry_at
            ]
        for job in due:
            if not job.share:
                job.written = True
                continue
            job.t_write = time.monotonic()
            self._write(job)
        return bool(due)

    def _write(self, job: _Job) -> None:
        m = job.manifest
        grant = job.grant
        assert grant is not None
        pieces = piece_spans(m.block_bytes, self._page_bytes)
        ppb = len(pieces)
        js = np.fromiter(job.share, dtype=np.int64)
        blocks = np.asarray(job.block_ids, dtype=np.int64)[js]
        pages = np.asarray(grant.pages, dtype=np.int64).reshape(m.num_blocks, ppb)[js]
        offs = np.array([o for o, _ in pieces], dtype=np.int64)
        lens = np.array([n for _, n in pieces], dtype=np.int64)
        spans = np.empty((len(js), ppb, 3), dtype=np.int64)
        spans[:, :, 0] = blocks[:, None] * m.block_bytes + offs[None, :]
        spans[:, :, 1] = pages * self._page_bytes
        spans[:, :, 2] = lens[None, :]
        assert self._remote is not None
        try:
            crc = job.checksum.result() if job.checksum is not None else None
        except Exception as e:
            log.exception("rank %d: cannot checksum %s", self.config.rank, job.request_id)
            self._give_up(job, f"cannot checksum its blocks: {type(e).__name__}: {e}")
            return
        notif = protocol.encode(protocol.WriteDone(request_id=job.request_id, checksum=crc))
        try:
            job.xfer = self._transport.write(
                self._reader_agent, self._local, self._remote, spans.reshape(-1, 3), notif
            )
        except TransportError as e:
            self._write_failed(job, e)

    def _write_failed(self, job: _Job, e: TransportError) -> None:
        """A WRITE failed inside NIXL: post it again after a backoff (a reader that is
        gone shows up as a lost connection meanwhile, and everything is resent after
        reconnecting); after ``WRITE_ATTEMPTS`` failures the request fails, and the
        reader is told to drop the sample."""
        job.xfer = None
        job.attempts += 1
        if job.attempts < WRITE_ATTEMPTS:
            log.warning(
                "rank %d: WRITE of %s failed in NIXL (%s); posting it again (attempt %d of %d)",
                self.config.rank,
                job.request_id,
                e,
                job.attempts + 1,
                WRITE_ATTEMPTS,
            )
            job.retry_at = time.monotonic() + WRITE_RETRY_S * job.attempts
            self.stats["write_retries"] += 1
            return
        self._give_up(job, f"its WRITE failed in NIXL {job.attempts} times (last: {e})")

    def _give_up(self, job: _Job, why: str) -> None:
        """Fail a granted request, and tell the reader to drop its sample (the other
        ranks' shares included: it can never complete)."""
        with self._lock:
            self._jobs.pop(job.request_id, None)
        self._record_failure(job.request_id, why)
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(
                    protocol.Refuse(code="write_failed", message=why[:4000], request_id=job.request_id)
                )

    def _poll_writes(self) -> bool:
        done_any = False
        for job in list(self._jobs.values()):
            if job.xfer is None:
                continue
            try:
                done = self._transport.poll(job.xfer)
            except TransportError as e:
                self._write_failed(job, e)
                continue
            if done:
                now = time.monotonic()
                self.stats["write_s"] += now - job.t_write
                job.t_write = now
                job.t_wait = now  # progress: its wait for a working reader starts again
                self.stats["bytes"] += job.xfer.nbytes
                job.xfer = None
                job.written = True
                done_any = True
        return done_any

    def _record_failure(self, request_id: str, why: str) -> None:
        log.error("request %s failed: %s", request_id, why)
        with self._lock:
            self._failed[request_id] = why

    def _fail_all(self, why: str) -> None:
        with self._lock:
            jobs = list(self._jobs)
            self._jobs.clear()
        while True:
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                break
        for rid in jobs:
            self._record_failure(rid, why)
