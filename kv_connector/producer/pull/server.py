"""One rank's pull endpoint (pull delivery), a thin I/O shell around its ledger
(``producer.pull.ledger.PullLedger``).

The rank registers the cache-only layer's tensor with its own NIXL agent once (no copy,
no staging) and listens on ``pull_listen``. The engine's thread ``hold``s each sample the
step computed. A consumer connects, with one thread per connection. It runs the handshake
of ``wire.handshake`` as the reader's side of it. With a shared secret, both ends prove it
before this rank's NIXL metadata leaves the node; that metadata goes once per connection.
The consumer then asks for samples by their handle's names:

- ``PullFetch`` is answered with the manifest and where this rank's share lies in the
  cache (``PullShare``); the consumer READs it itself.
- ``PullRelease`` ends the hold.
- ``PullKeep`` keeps it held, within the ledger's bound, for a consumer whose fetch agent
  is still starting.

The engine's thread takes what ended (``take_freed``) and reports it finished to vLLM,
which frees the blocks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from kv_connector.cache.blocks import CacheBlocks, Fingerprinted
from kv_connector.cache.hasher import Hasher
from kv_connector.common.device import on_device
from kv_connector.common.errors import ConfigurationError
from kv_connector.producer.pull.hold_fences import FENCE_SLOTS, WORD_BYTES, FenceTable
from kv_connector.producer.pull.ledger import Held, PullLedger, PullRefused
from kv_connector.producer.slot_check import StepGate
from kv_connector.wire import auth, block_digest, handshake, protocol
from kv_connector.wire.control import ConnectionClosed, FramedConnection, format_address, is_loopback
from kv_connector.wire.identity import make_identity
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.protocol import ProtocolError, ShareChecksum
from kv_connector.wire.provenance import Provenance
from kv_connector.wire.transport import Region, Transport

log = logging.getLogger(__name__)
T = TypeVar("T")

# how often the agent makes progress while a consumer may be reading
PROGRESS_S = 0.0002
# consumers served at once (a DataLoader worker holds one per rank)
MAX_CONNECTIONS = 256
# what a consumer may send after its handshake
REQUEST_FRAME = 4 << 10
# how often a connection's thread looks whether the endpoint closed
IDLE_POLL_S = 0.5
# a fetch may come before its sample is held: a request that ships its output tokens is
# held in the engine step after its response (and handle) went out
HOLD_WAIT_S = 5.0
# how long a fetch waits for the step that wrote its sample to be checked (on a GPU the
# slot check runs a step late; the handle goes out after that step returned, so it is rare)
GATE_WAIT_S = 5.0
GATE_POLL_S = 0.001


@dataclass(frozen=True)
class PullServerConfig:
    """Who one rank's pull endpoint serves as, where it listens and how it checks its shares.

    The connector builds one from its options and the rank's cache. Benchmarks and tests build
    their own, so the server's constructor keeps only the cache and its collaborators.

    ``layout``: the cache's block layout. ``listen``: (host, port) to bind; port 0 takes any
    free one. ``timeout_s``: how long a held sample waits for its release after its request
    finished. ``checksum``: each share's checksum kind (``ChecksumOption.resolve``); None sends
    none. ``secret``: the handshake's shared secret; None reads it from the environment
    (``wire.auth``). ``fences``: give every hold a fence word; False only to show what fences
    catch. ``provenance``: what produced the samples (``wire.provenance``).
    """

    layout: BlockLayout
    layer_ids: tuple[int, ...]
    producer_id: str
    listen: tuple[str, int]
    timeout_s: float
    rank: int = 0
    world_size: int = 1
    checksum: ShareChecksum | None = ShareChecksum.XXH3
    secret: bytes | None = None
    fences: bool = True
    provenance: Provenance | None = None


class PullServer:
    """Serves one rank's share of held samples to consumers that READ them.

    ``cache``: the cache-only layer's tensor, [num_blocks, ...] in ``config.layout``, registered
    once with ``transport`` (a ``NixlTransport`` by default). ``address`` names where it listens.
    ``clock``: the time the ledger's deadlines use. ``on_release``: called on a connection's
    thread when a consumer released a sample. Its blocks then go back to vLLM in the next step.
    """

    def __init__(
        self,
        cache: torch.Tensor,
        config: PullServerConfig,
        *,
        transport: Transport | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        layout, producer_id = config.layout, config.producer_id
        rank, world_size = config.rank, config.world_size
        checksum, fences = config.checksum, config.fences
        secret = config.secret if config.secret is not None else auth.load_secret()
        host, port = config.listen
        if checksum is ShareChecksum.BLOCKS and not block_digest.supported(layout):
            raise ConfigurationError(
                f"block digests need rows of whole 8-byte words; {layout.hidden_size} x {layout.dtype} is not"
            )
        if not secret and not is_loopback(host):
            raise ConfigurationError(
                f"a pull endpoint on {host} without a shared secret would let anyone who reaches it "
                "read this producer's cache: set KV_CONNECTOR_SECRET or KV_CONNECTOR_SECRET_FILE "
                '(the consumers need the same), or keep "pull_listen" on loopback'
            )
        self.config = config
        self.layout = layout
        self.layer_ids = [int(i) for i in config.layer_ids]
        self.producer_id = producer_id
        self.rank, self.world_size = rank, world_size
        self._secret = secret
        self._clock = clock
        # a consumer released a sample
        self._on_release = on_release or (lambda: None)
        self._checksum = checksum
        # its blocks, read only through here; a padded page's padding is never read
        self.blocks = CacheBlocks(cache, layout, config.provenance)
        self._sock = socket.create_server((host, port))
        try:
            if transport is None:
                from kv_connector.wire.nixl_transport import NixlTransport

                transport = NixlTransport(f"{producer_id}-pull-r{rank}-{os.getpid()}")
            self._transport = transport
            self._region = transport.register(self.blocks.raw)
            # host memory whatever the cache's device: the engine's thread writes it
            self._fence_words = torch.zeros(FENCE_SLOTS if fences else 1, dtype=torch.int64)
            self._fence_region = transport.register(self._fence_words) if fences else None
        except BaseException:
            self._sock.close()
            raise
        self.address = format_address(*self._sock.getsockname()[:2])
        self._me = handshake.ProducerIdentity(
            producer_id,
            rank,
            world_size,
            transport.name,
            layout.block_bytes,
            self._region.mem_type,
            checksum or ShareChecksum.XXH3,
        )
        # guards the ledger, the connections and the hashing
        self._lock = threading.Lock()
        # a sample was held (fetches may wait for it)
        self._held = threading.Condition(self._lock)
        table = FenceTable(self._fence_words.numpy().view(np.uint64)) if fences else None
        self._ledger = PullLedger(config.timeout_s, fences=table)
        self._prehash = checksum is ShareChecksum.XXH3 and cache.device.type == "cpu"
        # started on the first finished sample
        self._hasher: Hasher | None = None
        self._hashing: dict[tuple[str, str], concurrent.futures.Future[int]] = {}
        # each held sample's fingerprint words (with its nonce), until its hold ends
        self._words: dict[str, tuple[str, Fingerprinted]] = {}
        # the slot check of each held sample whose step was not checked when it was held
        self._gates: dict[str, tuple[str, StepGate]] = {}
        self._conns: set[FramedConnection] = set()
        self._closed = False
        # consumers that fetched and did not release yet: they may be reading, and a READ
        # moves only while this rank's agent makes progress (it has no progress thread)
        self._reading = 0
        self._wake = threading.Event()
        self._progress = threading.Thread(
            target=self._make_progress, name=f"hs-pull-r{rank}-nixl", daemon=True
        )
        self._progress.start()
        self._sock.settimeout(IDLE_POLL_S)
        self._thread = threading.Thread(target=self._accept, name=f"hs-pull-r{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- engine side
    @property
    def checksum_kind(self) -> ShareChecksum:
        """The kind of checksum this rank's shares carry (what its Hello says)."""
        return self._me.checksum_kind

    def hold(
        self,
        request_id: str,
        nonce: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        sample_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        words: Fingerprinted | None = None,
        ready: StepGate | None = None,
    ) -> None:
        """Hold a computed sample for consumers.

        ``block_ids``: the cache blocks of its tokens, in block-table order. ``words``: its
        fingerprint words as its steps took them, its record when this rank's checksum is
        FINGERPRINT. ``ready``: the slot check of the step that wrote it, when that step is
        not checked yet (on a GPU); no fetch is served before it passes, and one that fails
        fails the sample. ``ValueError`` if its id, identity or blocks cannot be served;
        nothing is held then."""
        ident = make_identity(sample_id, metadata)
        s = self.blocks.share_of(
            request_id, token_ids, block_ids, self.layer_ids, ident, self.rank, self.world_size
        )
        with self._lock:
            self._ledger.hold(request_id, nonce, s.manifest, s.block_ids, s.share, self._clock())
            if words is not None:
                self._words[request_id] = (nonce, words)
            if ready is not None:
                self._gates[request_id] = (nonce, ready)
            else:
                self._gates.pop(request_id, None)
            self._held.notify_all()

    def finished(self, request_ids: Iterable[str]) -> None:
        """These requests finished in vLLM and their handles are out: ``timeout_s`` starts.

        On a host cache their shares' checksums are taken in the background."""
        rids = list(request_ids)
        started: list[tuple[str, str, concurrent.futures.Future[int]]] = []
        with self._lock:
            self._ledger.finished(rids, self._clock())
            if not self._prehash or self._closed:
                return
            for rid in rids:
                h = self._ledger.holding(rid)
                if h is None or h.checksum is not None or not len(h.share) or (rid, h.nonce) in self._hashing:
                    continue
                if self._hasher is None:
                    self._hasher = Hasher(f"hs-pull-r{self.rank}-hash")
                fut = self._hasher.submit(functools.partial(self._share_checksum, h))
                self._hashing[(rid, h.nonce)] = fut
                started.append((rid, h.nonce, fut))
        # outside the lock: a done future calls back at once
        for rid, nonce, fut in started:
            fut.add_done_callback(functools.partial(self._hashed, rid, nonce))

    def _hashed(self, rid: str, nonce: str, fut: concurrent.futures.Future[int]) -> None:
        """A share's checksum taken in the background, kept if the sample is still held.

        Still held means its blocks were not given back to vLLM while they were read."""
        with self._lock:
            self._hashing.pop((rid, nonce), None)
            if fut.exception() is not None:
                # a fetch takes it again, and says what fails
                return
            try:
                self._ledger.check(rid, nonce, self._clock())
            except PullRefused:
                return
            self._ledger.set_checksum(rid, nonce, fut.result())

    def fail(self, request_id: str, nonce: str, why: str) -> None:
        """The sample could not be held; a consumer asking for it is told ``why``."""
        with self._lock:
            self._ledger.fail(request_id, nonce, f"could not be captured: {why}")

    def fail_held(self, request_id: str, why: str) -> bool:
        """A held sample turned out wrong (its step's slot check failed): its hold ends, and a
        consumer asking for it is told ``why``. False where it is not held."""
        with self._lock:
            if not self._ledger.is_held(request_id):
                return False
            self._ledger.fail(request_id, "", f"could not be captured: {why}")
            return True

    def _slots_wrong(self, rid: str, nonce: str) -> str | None:
        """Why a held sample's slots failed their check, once its step is checked; None when
        they passed, or it has no pending check under ``nonce``. Waits up to ``GATE_WAIT_S``
        for the step; call without the lock."""
        with self._lock:
            entry = self._gates.get(rid)
        if entry is None or entry[0] != nonce:
            return None
        gate = entry[1]
        deadline = time.monotonic() + GATE_WAIT_S
        while True:
            done, wrong = gate.poll(rid)
            if wrong is not None:
                return wrong
            if done:
                with self._lock:
                    if self._gates.get(rid) is entry:
                        del self._gates[rid]
                return None
            if time.monotonic() >= deadline:
                return f"the step that wrote it was not checked within {GATE_WAIT_S:.0f} s"
            time.sleep(GATE_POLL_S)

    def preempt(self, request_ids: Iterable[str]) -> list[str]:
        """vLLM reuses these requests' blocks from this step on: their holds end."""
        with self._lock:
            return self._ledger.preempt(request_ids)

    def drop(self, request_ids: Iterable[str]) -> list[str]:
        """These requests were aborted: their holds end."""
        with self._lock:
            return self._ledger.abort(request_ids)

    def take_freed(self) -> set[str]:
        """Samples whose hold ended since the last call; their blocks may go back to vLLM.

        Expired ones are logged by name."""
        with self._lock:
            expired = self._ledger.expire(self._clock())
            freed = self._ledger.take_freed()
            for rid in freed:
                self._words.pop(rid, None)
                self._gates.pop(rid, None)
        for rid in expired:
            log.warning(
                "pull: sample %s was not released within pull_timeout_s (%.0f s): its blocks are freed",
                rid,
                self._ledger.timeout_s,
            )
        return freed

    @property
    def region(self) -> Region:
        """The cache's registration (its flat bytes, ``CacheBlocks.raw``)."""
        return self._region

    @property
    def agent_metadata(self) -> bytes:
        """This rank's NIXL agent's metadata (what its handshake sends a consumer)."""
        return self._transport.metadata

    def keep_progress(self, on: bool) -> None:
        """Make the agent progress as while a consumer reads, for a peer that READs outside this protocol.

        A benchmark's raw READ is such a peer; this NIXL has no progress thread of its own.
        Calls with True and False pair up."""
        self._reading_changed(+1 if on else -1)

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._ledger)

    def close(self) -> None:
        """Stop serving: every hold ends, every connection closes, the memory is
        deregistered."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._held.notify_all()
            ended = self._ledger.close()
            conns, self._conns = list(self._conns), set()
        if ended:
            log.info("pull: %d samples still held at shutdown are dropped", len(ended))
        for c in conns:
            c.close()
        self._wake.set()
        self._thread.join(timeout=5)
        self._progress.join(timeout=5)
        if self._hasher is not None:
            self._hasher.close()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._transport.close()

    # ------------------------------------------------------------ consumer side
    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            conn = FramedConnection(sock, send_timeout=10.0)
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full and not self._closed:
                    self._conns.add(conn)
            if full or self._closed:
                log.warning(
                    "pull: refusing a connection from %s: %d consumers connected", peer, MAX_CONNECTIONS
                )
                conn.close()
                continue
            name = f"hs-pull-r{self.rank}-conn"
            threading.Thread(target=self._serve, args=(conn, str(peer[0])), name=name, daemon=True).start()

    def _serve(self, conn: FramedConnection, peer: str) -> None:
        # shares served on this connection and not released since
        outstanding = 0
        # block digests are computed on the cache's GPU here
        on_device(self.blocks.device)
        try:
            try:
                welcome = handshake.as_producer(conn, self._me, self._secret, self._transport.metadata)
            except (handshake.HandshakeError, ProtocolError, TimeoutError, ConnectionClosed, OSError) as e:
                log.warning("pull: a consumer at %s failed the handshake: %s", peer, e)
                return
            log.info(
                "pull: rank %d serves consumer agent %s (a %d MiB pool) at %s",
                self.rank,
                welcome.agent_name,
                welcome.pool_bytes >> 20,
                peer,
            )
            conn.max_frame = REQUEST_FRAME
            while not self._closed:
                try:
                    msg = conn.receive_one(IDLE_POLL_S)
                except TimeoutError:
                    continue
                answer = self.answer(msg)
                if isinstance(answer, protocol.PullShare):
                    outstanding += 1
                    self._reading_changed(+1)
                elif isinstance(msg, protocol.PullRelease) and outstanding:
                    outstanding -= 1
                    self._reading_changed(-1)
                if not isinstance(msg, protocol.PullRelease) or msg.answer:
                    conn.send(answer)
        except (ConnectionClosed, OSError):
            # the consumer went away
            pass
        except ProtocolError as e:
            log.warning("pull: dropping the consumer at %s: %s", peer, e)
            with contextlib.suppress(OSError):
                conn.send(protocol.Refuse(code="protocol", message=str(e)[:4000]))
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
            if outstanding:
                self._reading_changed(-outstanding)

    def _reading_changed(self, delta: int) -> None:
        with self._lock:
            self._reading += delta
            if self._reading > 0:
                self._wake.set()

    def _make_progress(self) -> None:
        # it drives the agent holding a GPU cache's registration
        on_device(self.blocks.device)
        while not self._closed:
            if not self._wake.wait(IDLE_POLL_S):
                continue
            with self._lock:
                if self._reading <= 0:
                    self._wake.clear()
                    continue
            # makes UCX progress for the consumers' READs
            self._transport.notifications()
            time.sleep(PROGRESS_S)

    def answer(
        self, msg: protocol.Message
    ) -> protocol.PullShare | protocol.PullReleased | protocol.PullKept | protocol.PullError:
        """The answer to one consumer request, as a connection's thread sends it.

        The request is ``PullFetch``, ``PullRelease`` or ``PullKeep``; any other message
        raises ``ProtocolError``."""
        if isinstance(msg, protocol.PullKeep):
            try:
                with self._lock:
                    held_s = self._held_for(msg.request_id, msg.nonce, self._ledger.keep)
            except PullRefused as e:
                return protocol.PullError(request_id=msg.request_id, code=e.code, message=e.message)
            log.info(
                "pull: sample %s kept for a consumer that is starting: held %.0f s more",
                msg.request_id,
                held_s,
            )
            return protocol.PullKept(request_id=msg.request_id, held_s=held_s)
        if isinstance(msg, protocol.PullRelease):
            try:
                with self._lock:
                    self._ledger.release(msg.request_id, msg.nonce, self._clock())
            except PullRefused as e:
                return protocol.PullError(request_id=msg.request_id, code=e.code, message=e.message)
            # its blocks go back to vLLM in the next step
            self._on_release()
            return protocol.PullReleased(request_id=msg.request_id)
        if not isinstance(msg, protocol.PullFetch):
            raise ProtocolError(f"expected a pull request, got {type(msg).__name__}")
        rid, nonce = msg.request_id, msg.nonce
        wrong = self._slots_wrong(rid, nonce)
        if wrong is not None:
            # never served: the fetch below says why
            self.fail_held(rid, wrong)
            # its blocks go back to vLLM in the next step
            self._on_release()
        try:
            with self._lock:
                h = self._held_for(rid, nonce, self._ledger.fetch)
                pending = self._hashing.get((rid, nonce))
            checksum = h.checksum
            if self._checksum is not None and checksum is None and len(h.share):
                if pending is not None and pending.exception() is None:
                    # taken since the request finished
                    checksum = pending.result()
                else:
                    checksum = self._share_checksum(h)
                with self._lock:
                    # computed from the blocks while they were still held: still held now,
                    # so they were not given back to vLLM meanwhile
                    self._ledger.check(rid, nonce, self._clock())
                    self._ledger.set_checksum(rid, nonce, checksum)
        except PullRefused as e:
            return protocol.PullError(request_id=rid, code=e.code, message=e.message)
        r = self._region
        return protocol.PullShare(
            manifest=h.manifest,
            rank=self.rank,
            world_size=self.world_size,
            first_block=h.share.start,
            block_ids=[h.block_ids[j] for j in h.share],
            cache_addr=r.addr,
            cache_bytes=r.nbytes,
            block_pitch=self.blocks.pitch,
            mem_type=r.mem_type,
            device_id=r.device_id,
            checksum=checksum if self._checksum is not None and len(h.share) else None,
            checksum_kind=self._checksum or ShareChecksum.XXH3,
            fence=self._fence_of(h),
        )

    def _fence_of(self, held: Held) -> protocol.HoldFence | None:
        f = self._fence_region
        if held.fence is None or f is None:
            return None
        slot, value = held.fence
        return protocol.HoldFence(
            table_addr=f.addr, table_bytes=f.nbytes, offset=slot * WORD_BYTES, value=value
        )

    def _held_for(self, rid: str, nonce: str, ask: Callable[[str, str, float], T]) -> T:
        """The ledger's answer to a fetch or a keep (``ask``); call with the lock held.

        It waits up to ``HOLD_WAIT_S`` for a sample not held yet. A request that ships its
        output tokens is held in the engine step after its handle went out. A wrong nonce
        waits the same, since P2 answers it exactly as an unknown request."""
        deadline = time.monotonic() + HOLD_WAIT_S
        while True:
            try:
                return ask(rid, nonce, self._clock())
            except PullRefused as e:
                left = deadline - time.monotonic()
                if e.code != "unknown" or self._closed or left <= 0:
                    raise
                self._held.wait(left)

    def _share_checksum(self, held: Held) -> int:
        """The checksum of this rank's share (``CacheBlocks.record``).

        It is the fingerprint from the words its steps took, or read from the cache while
        the sample is held. The handle is out only once the step that wrote the blocks
        returned, so they are written."""

        assert self._checksum is not None
        with self._lock:
            nonce, words = self._words.get(held.request_id, ("", None))
        return self.blocks.record(self._checksum, held, words if nonce == held.nonce else None)
