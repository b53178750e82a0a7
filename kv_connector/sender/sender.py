"""HiddenStatesSender: the producer side of one rank, as a thin I/O shell around the job
ledger (``ledger.SendLedger``): ``ship`` submits, the worker side takes what
finished or failed. Its thread (``loop.SenderLoop``) talks to the reader, its
``writer.ShareWriter`` posts and polls the WRITEs; every decision about a job
(when it may be written, retried, finished or failed) is the ledger's."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from kv_connector.cache.blocks import CacheBlocks, Fingerprinted
from kv_connector.common.errors import ConfigurationError

# its settings, built where it is
from kv_connector.sender.config import SenderConfig as SenderConfig
from kv_connector.sender.jobs import Job, log_failed
from kv_connector.sender.ledger import SendLedger
from kv_connector.sender.loop import LoopParts, SenderError, SenderLoop
from kv_connector.sender.stats import SenderMetrics, SenderStats
from kv_connector.sender.writer import SETTLE_S, ShareWriter
from kv_connector.wire import auth, handshake
from kv_connector.wire.failure import FailureReason, SampleFailure
from kv_connector.wire.identity import NO_IDENTITY, SampleIdentity
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.protocol import ShareChecksum
from kv_connector.wire.transport import Transport

log = logging.getLogger(__name__)


class ReadyGate(Protocol):
    """When a shipped request's blocks may be read (the producer's step barrier)."""

    def poll(self, request_id: str) -> tuple[bool, str | None]:
        """Without waiting: (the step that wrote them is done and checked, why the request
        must fail instead, or None)."""
        ...


class HiddenStatesSender:
    """Ships one rank's share of each request's hidden-state blocks.

    ``cache``: the cache-only layer's tensor, [num_blocks, ...] in ``layout``; registered
    with the transport once, never copied. ``transport``: the agent to ship with (a
    ``NixlTransport`` named after the producer, rank and process by default). ``ship``
    is thread-safe and returns at once; the ``take_finished`` / ``take_failed`` results
    come from a background thread.
    """

    def __init__(
        self,
        config: SenderConfig,
        cache: torch.Tensor,
        layout: BlockLayout,
        layer_ids: Sequence[int],
        secret: bytes | None = None,
        transport: Transport | None = None,
    ) -> None:
        # before any thread or agent
        secret = secret if secret is not None else auth.load_secret()
        self.config = config
        self.layout = layout
        self.layer_ids = list(layer_ids)
        if len(self.layer_ids) != layout.num_layers:
            raise ConfigurationError(f"{len(self.layer_ids)} layer ids for {layout.num_layers} layers")
        # its blocks, read only through here (``stage``: a testing hook, see CacheBlocks)
        self.blocks = CacheBlocks(cache, layout, config.provenance)
        # each shipped sample's, until it leaves
        self._words: dict[str, Fingerprinted] = {}
        if transport is None:
            from kv_connector.wire.nixl_transport import NixlTransport

            transport = NixlTransport(f"{config.producer_id}-r{config.rank}-{os.getpid()}")
        self._transport = transport
        self.agent_name = transport.name
        # the blocks' extent
        self._local = local = transport.register(self.blocks.raw)
        # why ``ship`` refuses: the engine sleeps (``suspend``)
        self._asleep: str | None = None
        # held jobs' gates (``ship``'s ``ready``)
        self._gates: dict[str, ReadyGate] = {}
        # guards the ledger, touched by ship() and the thread
        self._lock = threading.Lock()
        self._ledger = SendLedger(
            checksum=config.checksum is not None, connect_timeout_s=config.connect_timeout_s
        )
        self._loop: SenderLoop
        self._writer = writer = ShareWriter(
            transport,
            local,
            self._ledger,
            self._lock,
            config.rank,
            lambda f: self._loop.tell_reader(f),
            cache.device,
            block_pitch=self.blocks.pitch,
        )
        me = handshake.ProducerIdentity(
            config.producer_id,
            config.rank,
            config.world_size,
            transport.name,
            layout.block_bytes,
            "VRAM" if cache.is_cuda else "DRAM",
            config.checksum or ShareChecksum.XXH3,
            config.credits_ahead if config.world_size == 1 else 0,
        )
        parts = LoopParts(
            transport,
            self._ledger,
            self._lock,
            writer,
            self._share_checksum if config.checksum else None,
            cache.device,
            self._open_gates,
            inline_checksum=config.checksum is ShareChecksum.FINGERPRINT and cache.device.type == "cpu",
        )
        self._loop = SenderLoop(config, me, secret, parts)
        self._loop.start()

    @property
    def connected(self) -> threading.Event:
        """Set while a connection to the reader is up."""
        return self._loop.connected

    @property
    def link_error(self) -> str | None:
        """None while connected, else why not."""
        return self._loop.link_error

    # ------------------------------------------------------------- caller side
    def ship(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        identity: SampleIdentity = NO_IDENTITY,
        ready: ReadyGate | None = None,
        words: Fingerprinted | None = None,
    ) -> None:
        """Queue a request: ``token_ids`` are its tokens, ``block_ids`` the cache blocks
        holding them in block-table order (block j holds tokens j*block_size...);
        ``identity`` the user's name and metadata for the sample, checked where it was
        made (``kv_connector.wire.identity``). A request that cannot travel (its id, its
        blocks) raises ``ValueError``; a sender whose thread died raises ``SenderError``:
        either way nothing was queued. With ``ready``, nothing reads the blocks (no credit
        request, checksum or WRITE) before it says so, on this sender's thread; a request it
        fails fails by name (``take_failed``). ``words``: the sample's fingerprint words
        as its steps took them (its record when ``config.checksum`` is FINGERPRINT)."""
        if self._loop.dead is not None or self._loop.closed or self._asleep is not None:
            raise SenderError(self._loop.dead or self._asleep or "the sender is closed")
        c = self.config
        s = self.blocks.share_of(
            request_id, token_ids, block_ids, self.layer_ids, identity, c.rank, c.world_size
        )
        with self._lock:
            self._ledger.submit(request_id, s.manifest, s.block_ids, s.share, time.monotonic())
            self._ledger.hold(request_id, ready is not None)
            if words is not None:
                self._words[request_id] = words
        if ready is not None:
            # the sender's thread opens it (``_open_gates``)
            self._gates[request_id] = ready
        self._loop.wake()

    def count_unsafe(self, request_ids: Sequence[str]) -> int:
        """How many of ``request_ids`` are not safely written yet (see ``preempt``)."""
        with self._lock:
            return len(self._ledger.unsafe(request_ids))

    def preempt(self, request_ids: Sequence[str], timeout: float) -> list[str]:
        """The requests were preempted and their blocks are about to be reused: wait up to
        ``timeout`` seconds for their shares to be safely written (landed, and hashed
        where checksums are on), then freeze them: the ones that are not fail, and the
        reader is told (S8). Returns the request ids that failed."""
        deadline = time.monotonic() + timeout
        self._loop.wake()
        self._writer.wake()
        while True:
            with self._lock:
                waiting = self._ledger.unsafe(request_ids)
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.0005)
        with self._lock:
            failures = self._ledger.freeze(request_ids)
        log_failed(*failures)
        for f in failures:
            self._loop.tell_reader(f)
        return [f.request_id for f in failures]

    def suspend(self, timeout: float, why: str) -> list[str]:
        """The engine goes to sleep and releases the cache's memory: ``ship`` refuses from
        now on; the jobs in flight get up to ``timeout`` seconds to be acknowledged, the
        rest fail with ``why`` (the reader is told, and drops their samples); WRITEs in
        flight and the checksum being computed end, the connection is left, and the cache is
        deregistered. Nothing reads the cache after this returns. Returns the request ids
        that failed. Idempotent."""
        if self._asleep is not None:
            return []
        self._asleep = f"the engine is asleep: {why}"
        deadline = time.monotonic() + timeout
        self._loop.wake()
        self._writer.wake()
        while self.in_flight and time.monotonic() < deadline and self._loop.dead is None:
            time.sleep(0.001)
        with self._lock:
            rids = [j.request_id for j in self._ledger.jobs()]
            fails = (self._ledger.fail(rid, why, FailureReason.ASLEEP, code="preempted") for rid in rids)
            failures = [f for f in fails if f is not None]
        log_failed(*failures)
        for f in failures:
            # a WRITE in flight is polled to its end by the writer
            self._loop.tell_reader(f)
        if not self._loop.pause(self._asleep, SETTLE_S + 5.0) or not self._loop.hasher_idle(SETTLE_S):
            log.error("rank %d: the sender did not settle before sleeping", self.config.rank)
        self._transport.deregister(self._local)
        # the old memory's last view
        self.blocks.release()
        log.info(
            "rank %d asleep: %d requests failed, the cache's %d bytes deregistered",
            self.config.rank,
            len(failures),
            self._local.nbytes,
        )
        return [f.request_id for f in failures]

    def resume(self, cache: torch.Tensor) -> None:
        """The engine woke up: register ``cache`` again (the same geometry; its memory may
        be at another address now), and connect to the reader again, which loads the new
        registration from the handshake. Idempotent."""
        if self._asleep is None:
            return
        self.blocks.rebind(cache)
        self._local = self._transport.register(self.blocks.raw)
        self._writer.set_local(self._local)
        self._asleep = None
        self._loop.resume()
        log.info("rank %d awake: the cache is registered again at %#x", self.config.rank, self._local.addr)

    def _open_gates(self) -> bool:
        """On the sender's thread: release the held jobs whose step is done and checked,
        fail the ones whose check failed. True while some are still held."""
        if not self._gates:
            return False
        for rid in list(self._gates):
            done, why = self._gates[rid].poll(rid)
            if not done:
                continue
            del self._gates[rid]
            with self._lock:
                if rid not in self._ledger:
                    # failed meanwhile
                    continue
                if why is None:
                    self._ledger.hold(rid, False)
                    continue
                failure = self._ledger.fail(rid, why, FailureReason.OTHER)
            if failure is not None:
                log.error("request %s: %s; its hidden states will not be shipped", rid, why)
        return bool(self._gates)

    def take_finished(self) -> set[str]:
        """Request ids the reader acknowledged since the last call."""
        with self._lock:
            done = set(self._ledger.take_finished())
            for rid in done:
                self._words.pop(rid, None)
            return done

    def take_failed(self) -> dict[str, SampleFailure]:
        """Request ids that failed since the last call, with the reason."""
        with self._lock:
            failed = self._ledger.take_failed()
            for rid in failed:
                self._words.pop(rid, None)
            return failed

    def stats(self) -> SenderStats:
        """A snapshot of this sender's counters."""
        with self._lock:
            return self._ledger.stats.snapshot()

    def metrics_mark(self) -> tuple[int, ...]:
        """A mark of what ``take_metrics`` reports (read without the lock: an idle
        engine step costs a few attribute reads)."""
        return self._ledger.metrics_mark()

    def take_metrics(self) -> SenderMetrics:
        """For the metrics: counters, observations since the last call, requests in flight."""
        with self._lock:
            return self._ledger.take_metrics()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._ledger)

    @property
    def unwritten(self) -> int:
        """Requests whose blocks have not all landed in the reader yet."""
        with self._lock:
            return self._ledger.unwritten

    def close(self) -> None:
        if self._loop.closed:
            return
        self._loop.close()
        self._writer.close()
        self._transport.close()

    def _share_checksum(self, job: Job) -> int:
        """The checksum of this rank's share (on the hashing thread)."""
        t0 = time.perf_counter()
        assert self.config.checksum is not None
        with self._lock:
            words = self._words.get(job.request_id)
        value = self.blocks.record(self.config.checksum, job, words)
        with self._lock:
            self._ledger.hashed(time.perf_counter() - t0)
        return value
