"""The reader's sample ledger: every sample from its first credit request to the release
of its lease (or its refusal or discard), the receive pool's pages, the connected
producers (``producers.py``) and the samples already delivered. Pure logic (no nixl,
sockets, threads or clocks: times are passed in). The reader's shells (``server.py``
for connections and checks, ``core.py`` for the user) feed it what happened and perform
the actions it answers (``Send``, ``Verify``, ``Ready``, ``Log``; they and the sample and
share records are in ``records.py``). A peer's message that does not fit raises
``ProtocolError`` (the shell refuses that peer, and only it); a transition the state does
not allow raises ``IllegalSampleTransition``.

States of a sample (``SampleState``), keyed by (producer id, request id):

    (credit request) ----------------> PROMISED    waits in the pool's FIFO for a run of pages
    PROMISED   -- pages free --------> GRANTED     every rank's peer gets the Grant
    GRANTED    -- last share landed -> WRITTEN     every rank registered, every WRITE landed
    WRITTEN    -- last share checked > VERIFIED    queued for the user (Ready)
    GRANTED/WRITTEN -- a share fails > GRANTED     that rank writes it again (Rewrite)
    GRANTED/WRITTEN -- too many -----> refused     never handed out; its producer is told
    VERIFIED   -- hand_out ----------> HANDED_OUT  on lease to the user: a view of its pages;
                                                   the producer is acked (or, in manual
                                                   mode, when the user acks)
    GRANTED/WRITTEN -- deadline -----> refused     not complete sample_timeout_s after its grant
    HANDED_OUT -- release -----------> released    its pages return to the pool
    VERIFIED   -- reject ------------> refused     the consumer will not take it (its values);
                                                   pages quarantined, its producer told
    HANDED_OUT -- reject ------------> (stays)     not acked yet (manual mode): its producer
                                                   is told instead; pages return on release
    PROMISED/GRANTED/WRITTEN -- producer gone or gave up --> discarded (pages quarantined)

Each rank's share is checked as soon as it has landed and its digest is known (``Verify``,
carried out on the reader's checking thread), so a hand-out costs nothing per byte. A
share's landings are numbered: a check of an older landing is ignored.

A handed-out sample is remembered (``delivered``): a producer that resends it after a
reconnect gets an Ack, never a second copy.

Invariants (tests name the one they prove):
  R1  No credit, no write: a producer may write a sample only into the run of pages
      granted to it; a page belongs to at most one sample at a time.
  R2  A sample is handed out only when every rank of its producer registered its share,
      the shares tile the sample's blocks exactly, every non-empty share's WRITE landed
      and, where it carries a digest, matched it; at most once.
  R3  A sample's pages return to the pool only when its lease is released (the user
      released it, or no tensor of it is left), or, for a sample that can never
      complete, after a quarantine, so a late WRITE lands unseen; never while on lease.
  R4  A producer is acked for a sample only once the sample is the consumer's (handed
      out, or acknowledged by the user in manual mode); a resend of a delivered sample
      is acked, never delivered twice.
  R5  A share that fails its checksum is written again at most ``max_rewrites`` times;
      then the sample is refused, its producer told, and it is never handed out.
  R6  When no rank of a producer is left (after a grace for notifications still on
      their way), its incomplete samples are discarded; a rank that reconnects resends
      into the same pages.
  R7  Samples are granted in arrival order (FIFO): a large sample is not starved.
  R8  A granted sample not complete and checked within ``sample_timeout_s`` of its grant
      is refused to every rank and discarded: nobody holds pages for a sample that
      cannot complete (a rank that failed it, a lost notification). The wait for pages
      never counts (that is back-pressure, not a fault).
  R9  What one producer rank can make the ledger hold is bounded: samples promised and
      not handed out (``max_pending_per_rank``: over it, that peer is dropped), tokens
      per sample (``max_sample_tokens``: over it, that sample alone is refused).
  R10 A share that comes without a checksum where one is required (``require_checksum``:
      by default from producers whose cache is in host memory) refuses its sample.
  R11 A sample the consumer rejects (``reject``: non-finite or all-zero states, a file it
      cannot write) is refused to every rank of its producer with the reason and never
      acked; one already acked cannot be rejected.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from kv_connector.reader.pool import PagePool, PoolTooSmall
from kv_connector.reader.producers import PeerId, Producers
from kv_connector.reader.records import (
    AckMode,
    Action,
    IllegalSampleTransition,
    Key,
    Log,
    Ready,
    RequireChecksum,
    SampleRecord,
    SampleState,
    Send,
    Share,
    Verify,
)
from kv_connector.reader.stats import PoolState, ProducerTotals, ReaderStats
from kv_connector.wire import protocol
from kv_connector.wire.layout import pages_for
from kv_connector.wire.protocol import ProtocolError, ShareChecksum

MAX_REWRITES = 3
SAMPLE_TIMEOUT_S = 300.0  # a granted sample not complete by then is refused (never back-pressure:
# the wait for pages does not count)
MAX_PENDING_PER_RANK = 4096  # samples one producer rank may have promised and not seen handed out
MAX_SAMPLE_TOKENS = 1 << 20
QUARANTINE_S = 5.0  # pages of a discarded sample wait this long: a late WRITE lands unseen
LAST_NOTIFICATION_GRACE_S = 0.2  # how long a departed producer's last WriteDone may lag
DELIVERED_MEMORY = 100_000  # samples remembered for acking resends


class ReaderLedger:
    def __init__(
        self,
        ack_mode: AckMode = AckMode.ON_TAKE,
        already_delivered: Callable[[str, str], bool] | None = None,
        max_rewrites: int = MAX_REWRITES,
        quarantine_s: float = QUARANTINE_S,
        grace_s: float = LAST_NOTIFICATION_GRACE_S,
        delivered_memory: int = DELIVERED_MEMORY,
        verify: bool = True,
        require_checksum: RequireChecksum = RequireChecksum.AUTO,
        sample_timeout_s: float = SAMPLE_TIMEOUT_S,
        max_pending_per_rank: int = MAX_PENDING_PER_RANK,
        max_sample_tokens: int = MAX_SAMPLE_TOKENS,
    ) -> None:
        self.ack_mode = ack_mode
        self._already_delivered = already_delivered
        self.max_rewrites = max_rewrites
        self.quarantine_s = quarantine_s
        self.grace_s = grace_s
        self.delivered_memory = delivered_memory
        self.verify = verify
        self.require_checksum = require_checksum
        self.sample_timeout_s = sample_timeout_s
        self.max_pending_per_rank = max_pending_per_rank
        self.max_sample_tokens = max_sample_tokens
        self.stats = ReaderStats()
        self.pool: PagePool | None = None
        self.page_bytes: int | None = None
        self.samples: dict[Key, SampleRecord] = {}
        self.producers = Producers()
        # (producer, rank) -> its samples not handed out yet (the bound max_pending_per_rank)
        self._pending: collections.Counter[tuple[str, int]] = collections.Counter()
        # handed-out samples -> the peers still owed an Ack ([] once acked)
        self.delivered: collections.OrderedDict[Key, list[PeerId]] = collections.OrderedDict()

    # ------------------------------------------------------------------ pool
    def set_pages(self, page_bytes: int, num_pages: int) -> None:
        if self.pool is not None:
            raise IllegalSampleTransition("the pool's page size is decided once")
        self.page_bytes = page_bytes
        self.pool = PagePool(num_pages)

    # ---------------------------------------------------------------- queries
    def state_of(self, key: Key) -> SampleState | None:
        s = self.samples.get(key)
        return None if s is None else s.state

    def world_of(self, producer_id: str) -> int | None:
        return self.producers.world_of(producer_id)

    def rank_connected(self, producer_id: str, rank: int) -> bool:
        return self.producers.rank_connected(producer_id, rank)

    def identity(self, peer: PeerId) -> tuple[str, int] | None:
        """(producer id, rank) of a connected or departing peer."""
        return self.producers.identity(peer)

    @property
    def expecting_writes(self) -> bool:
        """A granted sample waits for a WRITE (its writers need this side's progress)."""
        return any(s.state is SampleState.GRANTED for s in self.samples.values())

    @property
    def departing(self) -> bool:
        return self.producers.departing

    def leases(self) -> list[SampleRecord]:
        """The samples on lease to the user, oldest first."""
        out = [s for s in self.samples.values() if s.state is SampleState.HANDED_OUT]
        return sorted(out, key=lambda s: s.t_handed_out)

    def pool_state(self) -> PoolState:
        """The pool's pages by what holds them (for metrics and progress lines)."""
        if self.pool is None or self.page_bytes is None:
            return PoolState()
        granted = leased = 0
        for s in self.samples.values():
            if s.pages is None:
                continue
            if s.state is SampleState.HANDED_OUT:
                leased += len(s.pages)
            else:
                granted += len(s.pages)
        p = self.pool
        return PoolState(
            self.page_bytes, p.num_pages, p.free_pages, granted, leased, p.quarantined_pages, p.waiting
        )

    def producers_connected(self) -> dict[str, int]:
        """Producer id -> how many of its ranks are connected."""
        return {pid: len(p.ranks) for pid, p in self.producers.by_id.items() if p.ranks}

    # ------------------------------------------------------------------ peers
    def peer_ready(self, peer: PeerId, hello: protocol.Hello) -> None:
        """A producer rank finished its handshake on connection ``peer``."""
        self.producers.ready(peer, hello)

    def peer_gone(self, peer: PeerId, now: float) -> list[Action]:
        """A connection closed. Its rank's slot is free at once (it may reconnect); its
        samples are judged after a grace in which its last notifications may still
        arrive (R6). Settled at once when nothing of it is awaited."""
        ident = self.producers.identity(peer)
        if ident is None:
            return []
        pid, rank = ident
        awaited = any(
            key[0] == pid and s.pages is not None and rank in s.shares and s.shares[rank].blocks
            and not s.shares[rank].landed
            for key, s in self.samples.items()
        )  # fmt: skip
        self.producers.gone(peer, now + (self.grace_s if awaited else 0.0))
        return self._departed(now)

    def _departed(self, now: float) -> list[Action]:
        """Departures whose grace is over: when no rank of a producer is left, its
        incomplete samples are discarded (R6)."""
        actions: list[Action] = []
        for pid in self.producers.departed(now):
            for key, s in list(self.samples.items()):
                if key[0] == pid and s.state in (SampleState.PROMISED, SampleState.GRANTED):
                    actions += self._discard(s, now, "its producer is gone")
        return actions

    def settle(self, peer: PeerId, now: float) -> list[Action]:
        """End a peer's departure now (its agent reconnects under a new connection,
        which takes over its notifications)."""
        self.producers.settle(peer, now)
        return self._departed(now)

    def forgotten(self, peer: PeerId) -> bool:
        """The peer's departure is over (the shell may forget its transport agent)."""
        return self.producers.forgotten(peer)

    # ------------------------------------------------------------- messages
    def credit_request(self, peer: PeerId, req: protocol.CreditRequest, now: float) -> list[Action]:
        pid, rank = self._ident(peer)
        prod = self.producers.by_id[pid]
        m = req.manifest
        key = (pid, m.request_id)
        if key in self.delivered or (self._already_delivered is not None and self._already_delivered(*key)):
            # a resend of a sample already handed out: acknowledge, never deliver twice (R4)
            self.stats.resends_acked += 1
            waiting = self.delivered.get(key)
            if waiting:  # handed out, its ack still awaited (manual mode): ack it then
                waiting.append(peer)
                return []
            return [Send(peer, protocol.Ack(request_id=m.request_id))]
        assert self.pool is not None and self.page_bytes is not None
        s = self.samples.get(key)
        if s is None and m.num_tokens > self.max_sample_tokens:
            self.stats.refused += 1
            self.stats.refused_limit += 1
            limit = self.max_sample_tokens
            why = f"request {m.request_id} has {m.num_tokens} tokens, over this reader's limit of {limit}"
            return [
                Send(peer, protocol.Refuse(code="limit", message=why, request_id=m.request_id)),
                Log("error", why),
            ]
        if s is None and self._pending_of(pid, rank) >= self.max_pending_per_rank:
            raise ProtocolError(
                f"{pid}/rank{rank} has {self.max_pending_per_rank} samples promised and not handed out: "
                "over its bound"
            )
        if s is None:
            s = SampleRecord(
                key, m, prod.world_size, pages_for(m.geometry.sample_bytes(m.num_blocks), self.page_bytes)
            )
            s.t_requested = now
            if not self.stats.first_request_t:
                self.stats.first_request_t = now
            try:
                self.pool.request(key, s.num_pages)
            except PoolTooSmall as e:
                self.stats.refused += 1
                self.stats.refused_pool_too_small += 1
                return [
                    Send(
                        peer,
                        protocol.Refuse(
                            code="pool_too_small", message=protocol.clip_text(str(e)), request_id=m.request_id
                        ),
                    ),
                    Log("error", f"request {m.request_id} refused: {e}"),
                ]
            self.samples[key] = s
        elif s.manifest != m:
            raise ProtocolError(f"rank {rank} sent a manifest of {m.request_id} that differs from the first")
        blocks = frozenset(req.blocks)
        share = s.shares.get(rank)
        if share is not None:
            if share.peer != peer and self.producers.current(pid, rank) == share.peer:
                raise ProtocolError(f"rank {rank} asked twice for {m.request_id}")
            if share.blocks != blocks:
                raise ProtocolError(f"rank {rank} changed its share of {m.request_id}")
            share.peer = peer  # the rank reconnected: it resends into the same pages
        else:
            for r, other in s.shares.items():
                if blocks & other.blocks:
                    raise ProtocolError(f"ranks {r} and {rank} both promise blocks of {m.request_id}")
            s.shares[rank] = Share(blocks, peer)
            self._pending[(pid, rank)] += 1
        if len(s.shares) == s.world_size:
            covered = set().union(*(sh.blocks for sh in s.shares.values()))
            if len(covered) != m.num_blocks:
                raise ProtocolError(f"the ranks' shares of {m.request_id} leave blocks unwritten")
        actions: list[Action] = []
        if s.pages is not None:
            actions.append(Send(peer, self._grant_msg(s)))
            actions += self._advance(s)
        return actions + self._grant(now)

    def write_done(self, peer: PeerId, msg: protocol.WriteDone, now: float = 0.0) -> list[Action]:
        """A rank's WRITE of its share landed (its notification arrived)."""
        s, share = self._share_of(peer, msg.request_id, "write_done")
        # a reconnected rank may land its share again into the same pages, also once the
        # sample is complete: the same bytes, the same digest
        if s.state in (SampleState.VERIFIED, SampleState.HANDED_OUT):
            return []
        if (
            msg.checksum is None
            and not msg.digest_follows
            and share.blocks
            and self._requires_checksum(s.key[0])
        ):
            why = (
                f"rank {self._ident(peer)[1]} of {s.key[0]} wrote its share of {msg.request_id} without the "
                "checksum this reader requires (the producer's checksum option is none; "
                "see --require-checksum)"
            )
            self.stats.refused += 1
            self.stats.refused_unchecked += 1
            refusals: list[Action] = [
                Send(p, protocol.Refuse(code="unchecked", message=why, request_id=msg.request_id))
                for p in s.peers.values()
            ]
            return [Log("error", why), *refusals, *self._discard(s, now, "unchecked")]
        share.landing += 1
        share.landed, share.checked, share.checking = True, False, None
        share.digest, share.digest_due = msg.checksum, msg.digest_follows
        if msg.digest_follows and share.early_digest is not None:
            share.digest, share.digest_due, share.early_digest = share.early_digest, False, None
        return self._advance(s)

    def share_digest(self, peer: PeerId, msg: protocol.ShareDigest) -> list[Action]:
        """The digest of a rank's share, sent after its WRITE was posted."""
        s, share = self._share_of(peer, msg.request_id, "share_digest")
        if share.landed and share.digest_due:
            share.digest, share.digest_due = msg.checksum, False
            return self._advance(s)
        share.early_digest = msg.checksum  # its WriteDone is still on its way
        return []

    def share_checked(self, key: Key, rank: int, landing: int, ok: bool, now: float) -> list[Action]:
        """The result of a ``Verify``: a share that matches is checked; one that does not
        is written again or, past ``max_rewrites``, its sample is refused (R5). A result
        for an older landing, or a sample gone meanwhile, is ignored."""
        s = self.samples.get(key)
        share = s.shares.get(rank) if s is not None else None
        if s is None or share is None or share.landing != landing or share.checking != landing:
            return []
        share.checking = None
        if ok:
            share.checked = True
            return self._advance(s)
        return self._mismatch(s, rank, now)

    def producer_refused(self, peer: PeerId, msg: protocol.Refuse, now: float) -> list[Action]:
        """A producer gave up on one of its samples (e.g. its WRITE kept failing): drop the
        sample, and tell its other ranks, whose shares can no longer complete it."""
        pid, rank = self._ident(peer)
        s = self.samples.get((pid, msg.request_id)) if msg.request_id else None
        label = f"{pid}/rank{rank}"
        if s is None or rank not in s.shares:
            return [Log("warning", f"{label} says: {msg.code} {msg.message}")]
        if s.state in (SampleState.VERIFIED, SampleState.HANDED_OUT):  # complete and checked
            return [
                Log("warning", f"{label} gave up on {msg.request_id}, which it had delivered: {msg.message}")
            ]
        actions: list[Action] = [
            Log("error", f"producer {label} gave up on {msg.request_id} ({msg.code}): {msg.message}")
        ]
        for r, other in s.peers.items():
            if r != rank:
                refuse = protocol.Refuse(
                    code=msg.code,
                    message=protocol.clip_text(f"rank {rank}: {msg.message}"),
                    request_id=msg.request_id,
                )
                actions.append(Send(other, refuse))
        return actions + self._discard(s, now, f"{label} gave up on it")

    # ------------------------------------------------------------- the user
    def hand_out(self, key: Key, nbytes: int, now: float) -> tuple[SampleRecord, list[Action]] | None:
        """VERIFIED -> HANDED_OUT: the user takes a ready sample on lease; it is remembered
        as delivered and its producer acked now (on take) or when the user acks (manual)
        (R4). None when it is not ready (discarded, or written again since it was queued)."""
        s = self.samples.get(key)
        if s is None or s.state is not SampleState.VERIFIED:
            return None
        s.state, s.t_handed_out = SampleState.HANDED_OUT, now
        self._settle_pending(s)
        self.stats.samples += 1
        self.stats.bytes += nbytes
        self.stats.tokens += s.manifest.num_tokens
        mine = self.stats.by_producer.get(key[0])
        if mine is None:
            mine = self.stats.by_producer[key[0]] = ProducerTotals()
        mine.samples += 1
        mine.tokens += s.manifest.num_tokens
        mine.bytes += nbytes
        self.stats.handout_latency.observe(now - s.t_requested)
        self.stats.last_handout_t = now
        self.delivered[key] = list(s.peers.values())
        while len(self.delivered) > self.delivered_memory:
            self.delivered.popitem(last=False)
        return s, (self.ack(key) if self.ack_mode is AckMode.ON_TAKE else [])

    def release(self, key: Key, now: float) -> list[Action]:
        """HANDED_OUT -> released: the lease ended; its pages return to the pool (R3).
        Releasing a sample that is not on lease (released already) does nothing."""
        s = self.samples.get(key)
        if s is None or s.state is not SampleState.HANDED_OUT:
            return []
        del self.samples[key]
        assert self.pool is not None and s.pages is not None
        self.pool.release(key, s.pages)
        return self._grant(now)

    def ack(self, key: Key) -> list[Action]:
        """The user acknowledges a delivered sample: its producer's ranks get their Ack."""
        waiting = self.delivered.get(key)
        if waiting is None:
            return []
        self.delivered[key] = []  # acked: a resend of it is acked at once
        return [Send(peer, protocol.Ack(request_id=key[1])) for peer in waiting]

    def reject(self, key: Key, why: str, now: float) -> list[Action]:
        """The consumer will not take a sample (R11): VERIFIED (checked before hand-out) ->
        refused, its pages quarantined; HANDED_OUT and not acked yet (manual mode): its
        producer's ranks are refused instead of acked, and a resend is delivered again.
        Its producer fails the request with ``reader refused (rejected): why``."""
        s = self.samples.get(key)
        waiting = self.delivered.get(key)
        if s is not None and s.state is SampleState.VERIFIED:
            peers = list(s.peers.values())
        elif s is not None and s.state is SampleState.HANDED_OUT and waiting:
            peers = waiting
            del self.delivered[key]
        else:
            state = s.state.value if s is not None else "gone"
            raise IllegalSampleTransition(
                f"cannot reject {key[1]} of {key[0]}: {state}, or acknowledged already"
            )
        self.stats.refused += 1
        refuse = protocol.Refuse(code="rejected", message=protocol.clip_text(why), request_id=key[1])
        actions: list[Action] = [Log("error", f"rejected request {key[1]} of producer {key[0]}: {why}")]
        actions += [Send(peer, refuse) for peer in peers]
        if s.state is SampleState.VERIFIED:
            assert self.pool is not None and s.pages is not None
            del self.samples[key]
            self.pool.quarantine(key, s.pages, now + self.quarantine_s)
        return actions

    # ----------------------------------------------------------------- time
    def tick(self, now: float) -> list[Action]:
        """Quarantines that ended give their pages back; departures whose grace ended
        are settled; granted samples past their deadline are refused."""
        actions = self._departed(now)
        actions += self._expire(now)
        if self.pool is not None and self.pool.end_quarantines(now):
            actions += self._grant(now)
        return actions

    # -------------------------------------------------------------- helpers
    def _expire(self, now: float) -> list[Action]:
        """A granted sample that is not complete and checked within ``sample_timeout_s``
        of its grant can wait for nothing but a producer that failed it (a rank that could
        not reach this reader, a lost notification): refuse it to every rank, free its
        pages (after the quarantine). The wait for pages never counts."""
        late = [
            s
            for s in self.samples.values()
            if s.state in (SampleState.GRANTED, SampleState.WRITTEN)
            and now - s.t_granted > self.sample_timeout_s
        ]
        actions: list[Action] = []
        for s in late:
            missing = sorted(r for r in range(s.world_size) if r not in s.shares or not s.shares[r].landed)
            why = (
                f"request {s.key[1]} of producer {s.key[0]} was not complete "
                f"{self.sample_timeout_s:.0f} s after its pages were granted (ranks {missing} missing)"
            )
            self.stats.refused += 1
            self.stats.refused_timeout += 1
            actions.append(Log("error", why))
            actions += [
                Send(p, protocol.Refuse(code="timeout", message=why, request_id=s.key[1]))
                for p in s.peers.values()
            ]
            actions += self._discard(s, now, "timeout")
        return actions

    def _requires_checksum(self, producer_id: str) -> bool:
        if not self.verify or self.require_checksum is RequireChecksum.NEVER:
            return False
        if self.require_checksum is RequireChecksum.ALWAYS:
            return True
        prod = self.producers.by_id.get(producer_id)
        return prod is None or prod.host_cache

    def _pending_of(self, producer_id: str, rank: int) -> int:
        return self._pending[(producer_id, rank)]

    def _settle_pending(self, s: SampleRecord) -> None:
        for rank in s.shares:
            k = (s.key[0], rank)
            self._pending[k] -= 1
            if self._pending[k] <= 0:
                del self._pending[k]

    def _ident(self, peer: PeerId) -> tuple[str, int]:
        ident = self.producers.identity(peer)
        if ident is None:
            raise IllegalSampleTransition(f"peer {peer} is not a connected producer")
        return ident

    def _share_of(self, peer: PeerId, request_id: str, what: str) -> tuple[SampleRecord, Share]:
        pid, rank = self._ident(peer)
        s = self.samples.get((pid, request_id))
        share = s.shares.get(rank) if s is not None else None
        if s is None or s.pages is None or share is None:
            raise ProtocolError(f"{what} for {request_id}, which it was not granted")
        return s, share

    def _grant_msg(self, s: SampleRecord) -> protocol.Grant:
        assert s.pages is not None
        return protocol.Grant(
            request_id=s.manifest.request_id, first_page=s.pages.start, num_pages=len(s.pages)
        )

    def _grant(self, now: float) -> list[Action]:
        """Runs of pages to waiting samples in arrival order while the head fits (R1, R7)."""
        if self.pool is None:
            return []
        actions: list[Action] = []
        for key, pages in self.pool.grantable():
            s = self.samples[key]  # type: ignore[index]
            s.pages, s.state, s.t_granted = pages, SampleState.GRANTED, now
            grant = self._grant_msg(s)
            actions += [Send(peer, grant) for peer in s.peers.values()]
            actions += self._advance(s)
        self.stats.peak_pages_used = max(self.stats.peak_pages_used, self.pool.used_pages)
        return actions

    def _advance(self, s: SampleRecord) -> list[Action]:
        """Check every share that landed with its digest known; move the sample on."""
        if s.state not in (SampleState.GRANTED, SampleState.WRITTEN):
            return []
        actions: list[Action] = []
        for rank, share in s.shares.items():
            if not share.landed or share.checked or share.checking is not None:
                continue
            if not self.verify or (share.digest is None and not share.digest_due):
                share.checked = True  # nothing to check it against
            elif share.digest is not None:
                share.checking = share.landing
                prod = self.producers.by_id.get(s.key[0])
                kind = prod.checksum if prod is not None else ShareChecksum.XXH3
                actions.append(Verify(s.key, rank, share.landing, share.digest, kind))
        if s.all_checked():
            s.state = SampleState.VERIFIED
            actions.append(Ready(s.key))
        elif s.all_landed():
            s.state = SampleState.WRITTEN
        return actions

    def _mismatch(self, s: SampleRecord, rank: int, now: float) -> list[Action]:
        m, key = s.manifest, s.key
        self.stats.checksum_mismatches += 1
        s.rewrites += 1
        if s.rewrites > self.max_rewrites:
            why = (
                f"request {m.request_id} of producer {key[0]} failed its checksum "
                f"{s.rewrites} times (rank {rank}); refusing it"
            )
            self.stats.refused += 1
            self.stats.refused_checksum += 1
            actions: list[Action] = [Log("error", why)]
            actions += [
                Send(peer, protocol.Refuse(code="checksum", message=why, request_id=m.request_id))
                for peer in s.peers.values()
            ]
            return actions + self._discard(s, now, "refused")
        if key[0] not in self.producers:  # nobody left to write it again
            gone = Log("error", f"request {m.request_id}: a share failed its checksum")
            return [gone, *self._discard(s, now, "its producer is gone")]
        share = s.shares[rank]
        share.landed = share.checked = False
        s.state = SampleState.GRANTED
        return [
            Log(
                "error",
                f"request {m.request_id} of producer {key[0]}: rank {rank}'s share does not match its "
                f"checksum; asking for it again ({s.rewrites} of {self.max_rewrites})",
            ),
            Send(
                share.peer,
                protocol.Rewrite(request_id=m.request_id, reason="the share does not match its checksum"),
            ),
        ]

    def _discard(self, s: SampleRecord, now: float, why: str) -> list[Action]:
        assert self.pool is not None
        del self.samples[s.key]
        self.stats.dropped += 1
        if s.state is not SampleState.HANDED_OUT:
            self._settle_pending(s)
        if s.pages is None:
            self.pool.cancel(s.key)
        else:
            self.pool.quarantine(s.key, s.pages, now + self.quarantine_s)
        return [Log("warning", f"discarded incomplete sample {s.key[1]} of producer {s.key[0]} ({why})")]
