"""The pull client: fetch a sample by its handle, READing its blocks straight from the producer's cache.

This is pull delivery, where the producer runs with ``"delivery": "pull"``. ``fetch(handle)``
takes the handle string or a response's whole ``kv_transfer_params``. It asks each rank for
its share (``PullFetch``: the manifest and where the share lies), READs every share into one
run of its receive pool, and checks each against its checksum (``reader.pool.memory``). It
screens the states for NaN/Inf and all-zero tokens (``reader.pool.values``) and releases the
sample on every rank, so the producer frees its blocks. It returns a
``reader.pool.lease.Sample``, a view of the pool whose pages return on release or collection.

The client makes one NIXL agent and one registered receive pool on first use, in host memory
or on a GPU (``pool_device="cuda:N"``). Until then it is picklable, and a copy starts afresh,
so a DataLoader can ship it to spawned workers. It keeps one authenticated control connection
per producer rank (``wire.handshake``); a broken one is made again once per request. It is
thread-safe: ``fetch_many`` and ``fetch_iter`` check each sample on a thread of their own
while they READ the next (``reader.pull.batch``).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kv_connector.reader.options import options_of
from kv_connector.reader.pool.hand_out import hand_out, values_verdict
from kv_connector.reader.pool.lease import CopyBuffers, Sample
from kv_connector.reader.pool.memory import (
    PoolMemory,
    check_share,
    device_of,
    make_pool,
    narrow_visibility,
    register_pool,
)
from kv_connector.reader.pool.pages import PagePool, PoolTooSmall
from kv_connector.reader.pool.values import RowsScreen
from kv_connector.reader.pull import batch
from kv_connector.reader.pull.hold_fences import HoldFenceReader, check_hold_fences
from kv_connector.reader.pull.links import PAGE_BYTES, FetchError, ProducerLinks
from kv_connector.reader.pull.options import PullOptions
from kv_connector.wire import protocol
from kv_connector.wire.handle import HandleError, PullHandle, decode_handle, handle_of
from kv_connector.wire.layout import pages_for
from kv_connector.wire.transport import Region, Transport, TransportError

log = logging.getLogger(__name__)

# between two looks at a full pool
RETRY_S = 0.002
# a READ polled after 50 us, then at most every 0.5 ms
POLL_FIRST_S, POLL_MAX_S = 0.00005, 0.0005


def byte_of(pages: range) -> int:
    """Where a run of the pool's pages starts, in bytes."""
    return pages.start * PAGE_BYTES


@dataclass
class _Asked:
    handle: PullHandle
    shares: list[protocol.PullShare]


@dataclass
class _Pending:
    handle: PullHandle
    shares: list[protocol.PullShare]
    pages: range
    xfers: list[Any]
    # the fences' outcome (``_check_hold_fences``) when they were READ as the data READs were
    # posted; None: not READ yet
    fenced: bool | FetchError | None = None


class PullClient:
    """Fetches pulled samples (see the module's docstring).

    ``options``: a ``PullOptions``, or its fields as keywords (``PullClient(pool_bytes=1 << 30)``),
    not both. ``secret``: the handshakes' shared secret, by default ``KV_CONNECTOR_SECRET`` or
    ``KV_CONNECTOR_SECRET_FILE``; without one the producer must listen on loopback.
    ``transport``: the agent to READ with (a ``NixlTransport`` by default). A GPU pool without a
    NIXL for this torch's CUDA raises ``TransportError`` naming the wheel here.
    """

    def __init__(
        self,
        options: PullOptions | None = None,
        *,
        secret: bytes | None = None,
        transport: Transport | None = None,
        **keywords: Any,
    ) -> None:
        self.options = options = options_of(PullOptions, options, keywords)
        pool_device = options.pool_device
        self._device = device_of(pool_device) if pool_device is not None else torch.device("cpu")
        if self._device.type == "cuda" and transport is None:
            from kv_connector.wire.nixl_transport import require_nixl

            # a GPU pool without a NIXL for this torch's CUDA: say so now
            require_nixl()
        self._secret = secret
        self._given_transport = transport
        self._reset()

    def _reset(self) -> None:
        # guards the pool, the peers and the agent
        self._lock = threading.Lock()
        self._transport: Transport | None = None
        self._region: Region | None = None
        self._pool: PagePool | None = None
        self._memory: PoolMemory | None = None
        self._links: ProducerLinks | None = None
        self._hold_fences: HoldFenceReader | None = None
        self._copies = CopyBuffers.for_pool(self.options.pool_bytes)
        self.name = self.options.name or f"pull-client-{uuid.uuid4().hex[:12]}"
        # fetch_iter's threads, made on use
        self._checker = batch.Checker(self.name, self._device)

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "secret": self._secret}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"], secret=state["secret"])  # type: ignore[misc]

    # ------------------------------------------------------------------ public
    def open(self, lap: Callable[[str], object] | None = None) -> None:
        """Make the NIXL agent and register the pool now (the first fetch does otherwise);
        ``lap`` is called with each phase's name as it ends (a fetch agent times its start)."""
        self._ensure(lap)

    @property
    def pool_fd(self) -> int | None:
        """The shared pool's memory file (``shared_pool=True``, once open), else None."""
        return getattr(self._memory, "fd", None)

    @property
    def registered_bytes(self) -> int:
        """Bytes of the pool registered with NIXL (0 before the first use)."""
        return 0 if self._region is None else self._region.nbytes

    @property
    def copies_made(self) -> int:
        """Buffers made for samples handed out as copies (``copy=True``): reused once a
        copy is collected, so this stays at the number in use at once."""
        return self._copies.allocated

    def pool_offset(self, tensor: torch.Tensor) -> int:
        """Where ``tensor``'s first element lies in the pool, in bytes from its start."""
        assert self._memory is not None, "the client has no pool yet"
        return tensor.data_ptr() - self._memory.tensor.data_ptr()

    def fetch(self, handle: str | Mapping[str, Any], release: bool = True) -> Sample:
        """The sample ``handle`` names, read, checked and released at its producer; ``FetchError`` if not.

        With ``release=False`` the producer holds it until ``release(handle)`` or its ``pull_timeout_s``.
        """
        return self._finish(self._post(self._ask(handle)), release)

    def fetch_many(self, handles: Iterable[str | Mapping[str, Any]]) -> list[Sample | FetchError]:
        """Several samples with their READs in flight together; each a ``Sample`` or the
        ``FetchError`` of that one (``fetch_iter`` with every one in flight)."""
        return list(self.fetch_iter(handles, in_flight=None))

    def fetch_iter(
        self, handles: Iterable[str | Mapping[str, Any]], in_flight: int | None = 4
    ) -> Iterator[Sample | FetchError]:
        """The samples of ``handles`` in order, each a ``Sample`` or that sample's ``FetchError``.

        Up to ``in_flight`` of them are asked for and READ ahead (None: all), and each is checked
        and released on the checker thread while the next ones are READ (``reader.pull.batch``). The
        pool must hold ``in_flight`` samples besides those you keep, so release each before taking
        the next; a plain ``for`` loop whose body drops the sample does.
        """
        stages = batch.Stages(self._ask, self._post, self._finish)
        return batch.fetch_iter(stages, self._checker, handles, in_flight)

    def manifest(self, handle: str | Mapping[str, Any]) -> protocol.Manifest:
        """What ``handle`` names, without reading it: the sample's manifest as its producer's rank 0 holds it.

        The producer keeps holding the sample; ``fetch`` or ``release`` it after.
        """
        h = self._decode(handle)
        self._ensure()
        return self._share_of(h, 0).manifest

    def release(self, handle: str | Mapping[str, Any]) -> None:
        """Let the producer free the sample's blocks (``fetch`` did already, on success; a
        sample released or gone already is no error)."""
        h = self._decode(handle)
        self._ensure()
        self._release_all(h, quiet=True)

    def close(self) -> None:
        self._checker.close()
        with self._lock:
            links, self._links = self._links, None
            transport, self._transport = self._transport, None
        if links is not None:
            links.close()
        if transport is not None:
            transport.close()

    def __enter__(self) -> PullClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ fetching
    def _decode(self, handle: str | Mapping[str, Any]) -> PullHandle:
        try:
            return decode_handle(handle_of(handle))
        except HandleError as e:
            raise FetchError("handle", str(e)) from None

    def _ask(self, handle: str | Mapping[str, Any]) -> _Asked:
        """Every rank's share of the sample (one round trip each): the first half of a
        fetch, which ``fetch_iter`` runs ahead on a thread of its own."""
        h = self._decode(handle)
        self._ensure()
        shares: list[protocol.PullShare] = []
        try:
            for rank in range(len(h.endpoints)):
                reply = self._share_of(h, rank)
                if shares and reply.manifest != shares[0].manifest:
                    raise FetchError("protocol", f"rank {rank}'s manifest differs from rank 0's")
                if not shares:
                    self._check_expected(reply.manifest)
                shares.append(reply)
        except FetchError:
            self._release_all(h, quiet=True)
            raise
        return _Asked(h, shares)

    def _check_expected(self, manifest: protocol.Manifest) -> None:
        """FetchError("mismatch") naming how the sample differs from ``expect``."""
        if self.options.expect is not None and (differs := self.options.expect.mismatches(manifest)):
            why = "; ".join(differs)
            raise FetchError("mismatch", f"{manifest.request_id} is not what this client expects: {why}")

    def _post(self, asked: _Asked) -> _Pending:
        """Pages for the sample and its READs posted.

        Where every READ completed as it was posted (UCX's shared memory copies then), the holds'
        fence words are READ here at once. On the checker thread a fence READ would wait for the
        agent's lock behind the next sample's copy.
        """
        h, shares = asked.handle, asked.shares
        try:
            pages = self._take_pages(h, shares[0].manifest)
        except FetchError:
            self._release_all(h, quiet=True)
            raise
        xfers = []
        try:
            for s in shares:
                if s.block_ids and (x := self._post_read(h, s, pages)) is not None:
                    xfers.append(x)
        except FetchError:
            self._settle(xfers)
            self._give_back(h, pages)
            self._release_all(h, quiet=True)
            raise
        p = _Pending(h, shares, pages, xfers)
        if not xfers:
            try:
                p.fenced = self._check_hold_fences(p)
            except FetchError as e:
                p.fenced = e
        return p

    def _share_of(self, handle: PullHandle, rank: int) -> protocol.PullShare:
        """Rank ``rank``'s answer to a ``PullFetch`` of the sample: its share, checked to be
        of this sample and rank; ``FetchError`` saying why not."""
        reply = self._ask_rank(
            handle,
            rank,
            handle.endpoints[rank],
            protocol.PullFetch(request_id=handle.request_id, nonce=handle.nonce),
        )
        if isinstance(reply, protocol.PullError):
            raise FetchError(reply.code, reply.message)
        if not isinstance(reply, protocol.PullShare):
            raise FetchError("protocol", f"expected a share, got {type(reply).__name__}")
        ours = reply.rank == rank and reply.world_size == handle.world_size
        if not ours or reply.manifest.request_id != handle.request_id:
            raise FetchError("protocol", f"rank {rank} answered for another sample or rank")
        return reply

    def _finish(self, pending: _Pending, release: bool = True) -> Sample:
        h, m = pending.handle, pending.shares[0].manifest
        try:
            self._wait(pending)
            fenced = self._check_hold_fences(pending) if pending.fenced is None else pending.fenced
            if isinstance(fenced, FetchError):
                raise fenced
            memory = self._memory
            assert memory is not None
            base = byte_of(pending.pages)
            check, full = self.options.check_values, self.options.full_values_check
            # the values screen samples
            sampled = check and not full
            # read with the fingerprints
            screens: list[RowsScreen | None] = []
            for s in pending.shares:
                blocks = list(range(s.first_block, s.first_block + len(s.block_ids)))
                if s.checksum is None:
                    screens.append(None)
                    continue
                got, screen = check_share(memory, base, m, blocks, s.checksum_kind, sampled)
                screens.append(screen)
                if got != s.checksum:
                    raise FetchError(
                        "checksum",
                        f"sample {h.request_id}: rank {s.rank}'s share does not match its checksum "
                        f"({s.checksum_kind.value}; its blocks changed while being read: expired?)",
                    )
            if check and (problem := values_verdict(memory, base, m, screens, full).problem):
                raise FetchError("values", f"sample {h.request_id} has bad hidden states: {problem}")
        except FetchError:
            self._give_back(h, pending.pages)
            self._release_all(h, quiet=True)
            raise
        if release and fenced:
            # the fences said the holds were live
            self._release_all(h, quiet=True, answer=False)
        elif release:
            unchecked = any(s.checksum is None and s.block_ids for s in pending.shares)
            self._release_all(h, quiet=not unchecked)
        key, copies = (h.producer_id, h.request_id), self._copies if self.options.copy else None
        return hand_out(
            memory, byte_of(pending.pages), m, key, lambda _k: self._give_back(h, pending.pages), copies
        )

    # ------------------------------------------------------------------ pool
    def _ensure(self, lap: Callable[[str], object] | None = None) -> None:
        # set last below: no waiting for a READ being posted
        if self._transport is not None:
            return
        lap = lap or (lambda _name: None)
        with self._lock:
            if self._transport is not None:
                return
            transport = self._given_transport
            if transport is None:
                from kv_connector.wire.nixl_transport import NixlTransport

                transport = NixlTransport(self.name, lap=lap)
            num_pages = self.options.pool_bytes // PAGE_BYTES
            memory = make_pool(num_pages * PAGE_BYTES, self.options.pool_device, self.options.shared_pool)
            lap("pool allocation")
            self._region = register_pool(transport, memory)
            lap("pool registration")
            narrow_visibility(memory, transport)
            self._memory = memory
            self._pool = PagePool(num_pages)
            self._links = ProducerLinks(
                self.name, self._secret, self.options.timeout_s, self._lock, transport, self._region
            )
            self._hold_fences = HoldFenceReader(transport, self._lock)
            self._transport = transport

    def _take_pages(self, handle: PullHandle, manifest: protocol.Manifest) -> range:
        """A run of pool pages for the sample, waited for while samples on lease fill the pool.

        Pages come back as samples are released, collected or their GPU work ends. ``FetchError``
        ("pool") if the pool can never hold the sample, it is being fetched already, or no room came
        within the client's timeout.
        """
        memory, pool = self._memory, self._pool
        assert memory is not None and pool is not None
        n = pages_for(manifest.geometry.sample_bytes(manifest.num_blocks), PAGE_BYTES)
        key = (handle.producer_id, handle.request_id, handle.nonce)
        rid, timeout_s, pool_bytes = handle.request_id, self.options.timeout_s, self.options.pool_bytes
        deadline = time.monotonic() + timeout_s
        collected = False
        while True:
            # leases whose GPU work is done give their pages back
            memory.lease_fences.settle()
            with self._lock:
                try:
                    pool.request(key, n)
                except PoolTooSmall as e:
                    raise FetchError("pool", f"{e} (PullClient pool_bytes={pool_bytes})") from None
                except ValueError as e:
                    raise FetchError("pool", f"sample {rid} is being fetched already: {e}") from None
                # nobody else waits (each request is made and cancelled under the lock)
                got = dict(pool.grantable())
                if key in got:
                    return got[key]
                pool.cancel(key)
            if time.monotonic() >= deadline:
                raise FetchError(
                    "pool",
                    f"no room for sample {rid} in the pool for {timeout_s:.0f} s: release the samples "
                    "you hold (sample.release(), or drop their tensors), or raise pool_bytes",
                )
            if not collected:
                # leases whose tensors are only in reference cycles
                gc.collect()
                collected = True
            time.sleep(RETRY_S)

    def _give_back(self, handle: PullHandle, pages: range) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.release((handle.producer_id, handle.request_id, handle.nonce), pages)

    # ------------------------------------------------------------------ transfers
    def _post_read(self, handle: PullHandle, share: protocol.PullShare, pages: range) -> Any | None:
        """Post the READ of a share; None when it completed as it was posted (UCX's shared
        memory copies then): the checker thread then need not wait for this lock."""
        m = share.manifest
        g, nb = m.geometry, m.num_blocks
        base = byte_of(pages)
        spans = []
        for i, block in enumerate(share.block_ids):
            j = share.first_block + i
            for src, dst, n in g.arranged_spans(nb, j):
                spans.append((base + dst, block * share.pitch + src, n))
        assert self._links is not None
        peer = self._links.agent(handle.endpoints[share.rank])
        remote = Region(share.cache_addr, share.cache_bytes, share.mem_type, share.device_id)
        with self._lock:
            assert self._transport is not None and self._region is not None
            try:
                xfer = self._transport.read(peer, self._region, remote, spans)
                return None if self._transport.poll(xfer) else xfer
            except TransportError as e:
                raise FetchError(
                    "transfer", f"cannot read sample {handle.request_id} from rank {share.rank}: {e}"
                ) from None

    def _wait(self, pending: _Pending) -> None:
        deadline = time.monotonic() + self.options.timeout_s
        waiting = list(pending.xfers)
        # then doubling: many fetches in flight (a fetch agent's) must not spin
        pause = POLL_FIRST_S
        while waiting:
            with self._lock:
                assert self._transport is not None
                try:
                    waiting = [x for x in waiting if not self._transport.poll(x)]
                except TransportError as e:
                    self._settle(waiting)
                    raise FetchError(
                        "transfer", f"reading sample {pending.handle.request_id} failed: {e}"
                    ) from None
            if waiting and time.monotonic() >= deadline:
                self._settle(waiting)
                raise FetchError(
                    "timeout",
                    f"reading sample {pending.handle.request_id} took over {self.options.timeout_s} s",
                )
            if waiting:
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)

    def _settle(self, xfers: list[Any]) -> None:
        """Wait (boundedly) for posted READs to end before their pages are reused."""
        deadline = time.monotonic() + self.options.timeout_s
        pause = POLL_FIRST_S
        for x in xfers:
            while time.monotonic() < deadline:
                with self._lock:
                    try:
                        if self._transport is None or self._transport.poll(x):
                            break
                    except TransportError:
                        break
                # not a spin: a READ that fails may take its time to end
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)

    # ------------------------------------------------------------------ control
    def _check_hold_fences(self, pending: _Pending) -> bool:
        """After the READs completed: every share's hold was live (``hold_fences``)."""
        assert self._links is not None and self._hold_fences is not None
        return check_hold_fences(
            self._hold_fences, self._links, pending.handle, pending.shares, self.options.timeout_s
        )

    def _release_all(self, handle: PullHandle, quiet: bool, answer: bool = True) -> None:
        for rank, endpoint in enumerate(handle.endpoints):
            msg = protocol.PullRelease(request_id=handle.request_id, nonce=handle.nonce, answer=answer)
            if not answer:
                if not self._links or not self._links.tell(handle, rank, endpoint, msg):
                    log.debug("releasing %s at rank %d: not sent (it expires)", handle.request_id, rank)
                continue
            try:
                reply = self._ask_rank(handle, rank, endpoint, msg)
            except FetchError as e:
                if not quiet:
                    raise
                log.debug("releasing %s at rank %d: %s", handle.request_id, rank, e)
                continue
            if isinstance(reply, protocol.PullError) and not quiet and reply.code != "released":
                raise FetchError(reply.code, reply.message)

    def _ask_rank(
        self, handle: PullHandle, rank: int, endpoint: str, msg: protocol.Message
    ) -> protocol.Message:
        assert self._links is not None
        return self._links.ask(handle, rank, endpoint, msg)


__all__ = ["FetchError", "PullClient", "handle_of"]
