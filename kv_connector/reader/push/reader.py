"""HiddenStatesReader: the push consumer's user API, handing out complete, checked samples on lease.

It owns the receive pool, registered once, the ledger of samples (``reader.push.ledger``), the
serving thread (``reader.push.server``) and the checking thread (``reader.push.checker``).
``get`` hands out the next sample as a view of the pool (``reader.pool.lease``), with no copy
and no pass over its bytes. Its producer gets its ``Ack``, and its pages return to the pool
when the lease ends.
"""

from __future__ import annotations

import gc
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kv_connector.common.errors import ClosedError, ConfigurationError, StateError
from kv_connector.reader.options import BoundSocket, ClientOptions, PositiveInt, PositiveSeconds, options_of
from kv_connector.reader.pool.hand_out import hand_out, values_verdict
from kv_connector.reader.pool.lease import CopyBuffers, Sample
from kv_connector.reader.pool.memory import make_pool, register_pool
from kv_connector.reader.push.ledger import SAMPLE_TIMEOUT_S, LedgerConfig, ReaderLedger
from kv_connector.reader.push.records import AckMode, Key, RequireChecksum
from kv_connector.reader.push.server import ReaderServer, ServerParts, round_page
from kv_connector.reader.push.stats import PoolState, ReaderStats
from kv_connector.wire import auth
from kv_connector.wire.control import format_address, is_loopback, parse_address
from kv_connector.wire.transport import PublishesPool, Transport

if TYPE_CHECKING:
    from kv_connector.reader.push.metrics_server import MetricsServer

log = logging.getLogger(__name__)

DEFAULT_MAX_LEASES = 64


def listen_socket(listen: str | socket.socket) -> socket.socket:
    """A non-blocking listening socket: bound to ``HOST:PORT`` here, or the caller's
    socket (already bound: it keeps its port) put into the listening state."""
    if isinstance(listen, socket.socket):
        if listen.type != socket.SOCK_STREAM or listen.getsockname()[1] == 0:
            raise ConfigurationError("the reader's listening socket must be a bound TCP socket")
        sock = listen
        sock.listen()
    else:
        host, port = parse_address(listen)
        sock = socket.create_server((host, port), reuse_port=False)
    sock.setblocking(False)
    return sock


def refuse_open_listen(host: str, address: str) -> None:
    """``ConfigurationError`` unless ``host`` is loopback (call when there is no secret)."""
    if not is_loopback(host):
        raise ConfigurationError(
            f"listening on {address} without a shared secret would let anyone who reaches it write "
            "into this reader's memory: set KV_CONNECTOR_SECRET or KV_CONNECTOR_SECRET_FILE (the "
            "producers need the same), or pass insecure=True (--insecure) on a trusted network"
        )


class ReaderClosed(ClosedError):
    """The reader was closed while waiting for a sample."""


class LeaseLimitError(StateError):
    """The user holds ``max_leases`` samples on lease and asks for another."""


class ReaderConfig(ClientOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a ``HiddenStatesReader`` listens, pools, checks and hands out, validated when built.

    It holds the options every client shares (``reader.options.ClientOptions``) and push's own; a
    bad value raises ``ConfigurationError`` (a ``ValueError``) naming it.

    ``listen``: the control address ``HOST:PORT`` (port 0 picks one; ``address`` tells it), or a
    socket already bound to one. A caller holding the socket, such as one inherited from a
    supervisor, never releases the port between choosing and listening. The reader closes it.
    ``page_bytes``: the pool's page size, rounded up to a multiple of 64; by default the first
    producer's block size.
    ``ack``: ``AckMode.ON_TAKE`` ("on_take") acknowledges a sample when ``get`` hands it out, so
    its producer frees its blocks. ``MANUAL`` ("manual") waits for ``ack(sample)``, for example
    once the sample is durably written.
    ``verify``: check each share against its producer's checksum as it lands (on by default). A
    mismatch is logged and the share written again, at most ``ledger.MAX_REWRITES`` times; then
    the sample is refused and its producer fails it.
    ``max_leases``: how many samples the user may hold on lease at once; ``get`` raises
    ``LeaseLimitError`` beyond it, naming them.
    ``require_checksum``: "auto" (default) refuses shares without a checksum from producers whose
    cache is in host memory, where hashing costs little. "always" refuses them from every
    producer, and "never" accepts them.
    ``sample_timeout_s``: a sample granted pages and not complete this long after is dropped and
    its producer told (default 300).
    ``insecure``: allow a non-loopback address without a shared secret. That is refused by
    default, since anyone who reaches the port could write into the pool.
    ``metrics_address``: serve Prometheus metrics (``GET /metrics``) on ``HOST:PORT`` or a bound
    TCP socket.
    ``node_pool``: keep the host pool in a memory file and offer it to producers on this node
    (``wire.node_pool``). They then copy each share into it instead of a WRITE through UCX,
    which has no zero-copy path from a GPU into another process's host memory. Producers on
    other nodes, and those with ``KV_CONNECTOR_NODE_POOL=0``, WRITE as before.

    The values check runs on the user's thread, in the ``get`` that reaches the sample. A bad
    sample is logged by name and refused to its producer (``reject``), never handed out. A sample
    that differs from ``expect`` is refused when its producer asks for pages.
    """

    listen: str | BoundSocket = "127.0.0.1:0"
    page_bytes: PositiveInt | None = None
    ack: AckMode = AckMode.ON_TAKE
    verify: bool = True
    max_leases: PositiveInt = DEFAULT_MAX_LEASES
    require_checksum: RequireChecksum = RequireChecksum.AUTO
    sample_timeout_s: PositiveSeconds = SAMPLE_TIMEOUT_S
    insecure: bool = False
    metrics_address: str | BoundSocket | None = None
    node_pool: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.node_pool and self.pool_device is not None:
            raise ConfigurationError("node_pool offers a host pool to producers: leave pool_device unset")
        if self.page_size is not None and self.page_size > self.pool_bytes:
            raise ConfigurationError(f"page_bytes {self.page_size} exceeds pool_bytes {self.pool_bytes}")

    @property
    def page_size(self) -> int | None:
        """``page_bytes`` rounded up to a multiple of 64 (None: the first producer's block)."""
        return None if self.page_bytes is None else round_page(self.page_bytes)


class HiddenStatesReader:
    """Receives hidden states from producers over NIXL.

    ``config``: a ``ReaderConfig``, or its fields as keywords (``HiddenStatesReader(pool_bytes=
    1 << 30)``), not both. ``secret``: the handshake's shared secret, by default from
    ``KV_CONNECTOR_SECRET`` or ``KV_CONNECTOR_SECRET_FILE``; without one producers are not
    authenticated. ``already_delivered(producer_id, request_id)``: samples delivered before this
    reader started; a producer resending one gets its ``Ack`` without a transfer. ``transport``:
    the agent to receive with (a ``NixlTransport`` by default). ``metrics_address`` names the
    metrics address really served, and ``metrics`` the server (``reader.push.metrics``).

    Iterate over it or call ``get`` for ``Sample``s; close it, or use it as a context manager.
    The iterator ends a sample's lease when you ask for the next; reading its ``hidden_states``
    then raises ``SampleReleased``. A sample you ``keep()``, or whose tensor or view you hold,
    returns its pages on ``release`` or when the last of them is collected.
    """

    def __init__(
        self,
        config: ReaderConfig | None = None,
        *,
        secret: bytes | None = None,
        already_delivered: Callable[[str, str], bool] | None = None,
        transport: Transport | None = None,
        **options: Any,
    ) -> None:
        self.config = config = options_of(ReaderConfig, config, options)
        listen, pool_bytes, page_bytes = config.listen, config.pool_bytes, config.page_size
        self.max_leases = config.max_leases
        self._copy = config.copy
        self._check_values = config.check_values
        self._full_values_check = config.full_values_check
        secret = secret if secret is not None else auth.load_secret()
        self.reader_id = config.name or f"reader-{uuid.uuid4().hex[:12]}"
        self._ledger = ReaderLedger(
            LedgerConfig(
                ack_mode=config.ack,
                verify=config.verify,
                require_checksum=config.require_checksum,
                sample_timeout_s=config.sample_timeout_s,
                expect=config.expect,
            ),
            already_delivered,
        )
        if page_bytes is not None:
            self._ledger.set_pages(page_bytes, pool_bytes // page_bytes)
        insecure = config.insecure
        if not secret and not insecure and isinstance(listen, str):
            # before binding anything
            refuse_open_listen(parse_address(listen)[0], listen)
        lsock = listen_socket(listen)
        real_host, real_port = lsock.getsockname()[:2]
        self.address = format_address(real_host, real_port)
        if not secret and not insecure:
            try:
                refuse_open_listen(real_host, self.address)
            except ValueError:
                lsock.close()
                raise
        if not secret:
            log.warning("no shared secret: producers are not authenticated (listening on %s)", self.address)
        self._copies = CopyBuffers.for_pool(pool_bytes)
        try:
            self._memory = make_pool(pool_bytes, config.pool_device, shared=config.node_pool)
            if transport is None:
                from kv_connector.wire.nixl_transport import NixlTransport

                transport = NixlTransport(self.reader_id)
            self._transport = transport
            region = register_pool(transport, self._memory)
            fd = getattr(self._memory, "fd", None)
            if fd is not None and isinstance(transport, PublishesPool):
                transport.publish_pool(region, fd)
        except Exception:
            lsock.close()
            raise
        self._lock = threading.RLock()
        self._ready: queue.Queue[Key | None] = queue.Queue()
        self._closed = False
        parts = ServerParts(
            listen=lsock,
            transport=transport,
            region=region,
            ledger=self._ledger,
            lock=self._lock,
            pool=self._memory,
            secret=secret,
            reader_id=self.reader_id,
            on_ready=self._ready.put,
            screen=config.check_values and not config.full_values_check,
        )
        self._server = ReaderServer(parts)
        self._server.start()
        self.metrics: MetricsServer | None = None
        self.metrics_address: str | None = None
        if config.metrics_address is not None:
            try:
                self.metrics = serve_metrics(self, config.metrics_address)
            except BaseException:
                self.close()
                raise
            self.metrics_address = self.metrics.address
        log.info(
            "hidden-states reader %s listening on %s, pool %.1f MiB on %s%s%s",
            self.reader_id,
            self.address,
            pool_bytes / (1 << 20),
            self._memory.device if config.pool_device is not None else "the host",
            ", handshake authenticated" if secret else "",
            f", metrics on {self.metrics.url}" if self.metrics else "",
        )

    # ---------------------------------------------------------------- user side
    def get(self, timeout: float | None = None, copy: bool | None = None) -> Sample:
        """The next complete, checked sample, on lease as a view of the pool or copied out with ``copy``.

        Raises ``TimeoutError`` after ``timeout`` seconds, ``ReaderClosed`` once closed, and
        ``LeaseLimitError`` when the user holds ``max_leases`` samples on lease.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        copy = self._copy if copy is None else copy
        while True:
            if self._closed:
                raise ReaderClosed("the reader is closed")
            if not copy:
                self._check_lease_limit()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                key = self._ready.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"no sample within {timeout} s") from None
            if key is None:
                self._ready.put(None)
                raise ReaderClosed("the reader is closed")
            sample = self._hand_out(key, copy)
            if sample is not None:
                return sample
            # discarded since it was queued

    def __iter__(self) -> Iterator[Sample]:
        return self.samples()

    def samples(self, max_samples: int | None = None, timeout: float | None = None) -> Iterator[Sample]:
        """Yield up to ``max_samples`` samples, each within ``timeout`` seconds.

        Asking for the next one ends the previous one's lease, so a pool that holds one sample serves
        a plain ``for`` loop. A sample you ``keep()``, or whose tensor or view you hold, stays leased
        until released or collected.
        """
        n = 0
        prev: Sample | None = None
        while max_samples is None or n < max_samples:
            if prev is not None:
                prev.let_go()
                prev = None
            try:
                prev = self.get(timeout)
            except ReaderClosed:
                return
            n += 1
            yield prev

    def ack(self, sample: Sample) -> None:
        """Tell the sample's producer it is safe here (``ack="manual"``): it frees the
        sample's blocks, and will not resend it after a reconnect."""
        with self._lock:
            self._server.perform(self._ledger.ack((sample.producer_id, sample.request_id)))

    def reject(self, sample: Sample, why: str) -> None:
        """Refuse a handed-out sample not acknowledged yet (``ack="manual"``).

        Its producer fails the request with ``why`` instead of freeing it as delivered, for example
        when the sample's file cannot be written. Release its lease as usual.
        """
        with self._lock:
            self._server.perform(
                self._ledger.reject((sample.producer_id, sample.request_id), why, time.monotonic())
            )

    @property
    def copies_made(self) -> int:
        """Buffers made for samples handed out as copies (``copy=True``): reused once a
        copy is collected, so this stays at the number in use at once."""
        return self._copies.allocated

    def ready_samples(self, producer_id: str | None = None) -> list[tuple[str, str]]:
        """The (producer id, request id) of the samples complete and checked, not yet
        taken (of ``producer_id`` only, when given)."""
        with self._lock:
            return self._ledger.view.ready(producer_id)

    def stats(self) -> ReaderStats:
        """A snapshot of this reader's counters."""
        with self._lock:
            return self._ledger.stats.snapshot()

    def pool_state(self) -> PoolState:
        """The receive pool's pages now: free, granted (samples on their way), leased (to
        the user), quarantined; and the samples waiting for pages."""
        with self._lock:
            return self._ledger.view.pool_state()

    def producers_connected(self) -> dict[str, int]:
        """Producer id -> ranks connected now."""
        with self._lock:
            return self._ledger.view.producers_connected()

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
        if self.metrics is not None:
            self.metrics.close()
        self._server.close()
        with self._lock:
            self._transport.close()
        log.info("hidden-states reader %s closed (%d samples)", self.reader_id, self._ledger.stats.samples)

    # ------------------------------------------------------------- hand-out
    def _check_lease_limit(self) -> None:
        with self._lock:
            self._server.take_releases()
            held = self._ledger.view.leases()
        if len(held) < self.max_leases:
            return
        # leases whose tensors are only in reference cycles
        gc.collect()
        with self._lock:
            self._server.take_releases()
            held = self._ledger.view.leases()
        if len(held) >= self.max_leases:
            names = ", ".join(s.key[1] for s in held[:8])
            raise LeaseLimitError(
                f"you hold {len(held)} samples on lease (max_leases={self.max_leases}: {names}, ...): "
                "release them (sample.release(), a with block, or drop their tensors), read with "
                "copy=True, or raise max_leases"
            )

    def _bad_values(self, key: Key) -> bool:
        """Check a CHECKED sample's states where they lie (nothing writes a checked
        sample's pages, so outside the lock); a bad one is rejected. True if it was."""
        with self._lock:
            ready = self._ledger.ready_sample(key)
            if ready is None:
                return False
            m, base, screens = ready.manifest, ready.base, ready.screens
        verdict = values_verdict(self._memory, base, m, screens, self._full_values_check)
        problem = verdict.problem
        with self._lock:
            if verdict.looked_s is not None:
                self._ledger.values_checked(verdict.looked_s)
            if problem is None:
                return False
            name = m.request_id if m.sample_id is None else f"{m.request_id} (sample {m.sample_id})"
            log.error("hidden-states reader: %s of producer %s has bad states: %s", name, key[0], problem)
            self._server.perform(self._ledger.reject(key, f"bad hidden states: {problem}", time.monotonic()))
            return True

    def _hand_out(self, key: Key, copy: bool) -> Sample | None:
        if self._check_values and self._bad_values(key):
            return None
        with self._lock:
            got = self._ledger.hand_out(key, time.monotonic())
            if got is None:
                # discarded since it was queued
                return None
            ready, actions = got
            self._server.perform(actions)
        t0 = time.perf_counter()
        copies = self._copies if copy else None
        sample = hand_out(self._memory, ready.base, ready.manifest, key, self._server.release, copies)
        if copy:
            with self._lock:
                self._ledger.copied(time.perf_counter() - t0)
        return sample


def serve_metrics(reader: HiddenStatesReader, listen: str | socket.socket) -> MetricsServer:
    """A Prometheus endpoint for ``reader`` (prometheus_client is imported only here)."""
    from kv_connector.reader.push.metrics import ReaderCollector
    from kv_connector.reader.push.metrics_server import MetricsServer

    return MetricsServer(listen, [ReaderCollector(reader)])
