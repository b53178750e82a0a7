"""The push reader's sample ledger: every sample from its first credit request to its lease's end.

Pure logic: no nixl, sockets, threads or clocks, so times are passed in. The reader's shells
(``server.py``, ``checker.py``, ``reader.py``) feed it what happened and perform the actions
it answers (``Send``, ``CheckShare``, ``Ready``, ``Log``, in ``records.py``). Only the ledger
counts and decides. A peer's message that does not fit raises ``ProtocolError``, and the
shell refuses that peer alone. A transition the state does not allow raises
``IllegalSampleTransition``. Its samples and pages are kept in ``book.py``, those delivered
in ``delivered.py``, the producers in ``producers.py``; ``refusals.py`` ends a sample not to
be delivered.

A sample's states, its ends (released, refused, discarded) and the one table of its legal
transitions are ``sample_states.py``'s, which draws them. Every transition goes through that
table (``SampleRecord.move``, ``SampleBook.drop``), so a sample never moves where the drawing
does not. The ledger decides which event happens, and when.

Each rank's share is checked on the checking thread as soon as it has landed and its checksum
is known (``CheckShare``), so a hand-out costs nothing per byte. A check of an older landing is
ignored; landings are numbered.

Invariants (tests name the one they prove):
  R1  No credit, no write: a producer may write a sample only into the run of pages
      granted to it; a page belongs to at most one sample at a time.
  R2  A sample is handed out only when every rank of its producer registered its share,
      the shares tile the sample's blocks exactly, every non-empty share's WRITE landed
      and, where it carries a checksum, matched it; at most once.
  R3  A sample's pages return to the pool only when its lease is released (the user
      released it, or no tensor of it is left), or, for a sample that can never
      complete, once no WRITE into them can land: each rank sent the grant (or a
      Rewrite) whose WriteDone has not come fences it (``Fenced``, or its late WriteDone
      of that grant's generation), a departed rank after a quarantine, a silent one after
      ``fence_bound_s`` (then a WriteDone of that grant fails what holds the pages);
      never while on lease. A WriteDone of an older grant never lands on a sample.
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
  R12 Credits ahead (``credits.py``) go only to a producer of one rank that asked for
      them, only while no sample waits for pages, and are recalled once one does; a
      sample placed in one holds the run's first pages under the credit's generation,
      the rest go back at once; a credit whose holder left waits a quarantine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kv_connector.reader.pool.pages import PoolTooSmall
from kv_connector.reader.pool.values import RowsScreen
from kv_connector.reader.push.book import SampleBook
from kv_connector.reader.push.credits import Credits, HeldCredit
from kv_connector.reader.push.delivered import Delivered
from kv_connector.reader.push.producers import PeerId, Producers
from kv_connector.reader.push.records import (
    AckMode,
    Action,
    IllegalSampleTransition,
    Key,
    Log,
    ReadySample,
    RequireChecksum,
    SampleRecord,
    SampleState,
    Send,
    Share,
)
from kv_connector.reader.push.refusals import Refusals
from kv_connector.reader.push.sample_states import SampleEvent, move
from kv_connector.reader.push.stats import ReaderStats
from kv_connector.reader.push.view import LedgerView
from kv_connector.wire import protocol
from kv_connector.wire.layout import pages_for
from kv_connector.wire.protocol import ProtocolError, ShareChecksum
from kv_connector.wire.provenance import Expectation

MAX_REWRITES = 3
# a granted sample not complete by then is refused (never back-pressure:
SAMPLE_TIMEOUT_S = 300.0
# the wait for pages does not count)
# samples one producer rank may have promised and not seen handed out
MAX_PENDING_PER_RANK = 4096
MAX_SAMPLE_TOKENS = 1 << 20
# a departed writer's WRITEs settle in this time (the sender's SETTLE_S)
QUARANTINE_S = 5.0
# the longest a dropped sample's pages wait for a connected writer's fence
FENCE_BOUND_S = 60.0
# how long a departed producer's last WriteDone may lag
LAST_NOTIFICATION_GRACE_S = 0.2
# samples remembered for acking resends
DELIVERED_MEMORY = 100_000


@dataclass(frozen=True)
class LedgerConfig:
    """The ledger's policy: how it acks, what it checks, and the bounds and waits of R3 to R10.

    The reader builds one from its ``ReaderConfig``; tests set single bounds to reach their case.
    """

    ack_mode: AckMode = AckMode.ON_TAKE
    # R5
    max_rewrites: int = MAX_REWRITES
    # R3: a departed writer's pages
    quarantine_s: float = QUARANTINE_S
    # R3: a silent writer's pages
    fence_bound_s: float = FENCE_BOUND_S
    # R6
    grace_s: float = LAST_NOTIFICATION_GRACE_S
    # R4
    delivered_memory: int = DELIVERED_MEMORY
    verify: bool = True
    # R10
    require_checksum: RequireChecksum = RequireChecksum.AUTO
    # R8
    sample_timeout_s: float = SAMPLE_TIMEOUT_S
    # R9
    max_pending_per_rank: int = MAX_PENDING_PER_RANK
    # R9
    max_sample_tokens: int = MAX_SAMPLE_TOKENS
    # what samples must be, else they are refused
    expect: Expectation | None = None


class ReaderLedger:
    """The push reader's decisions: every producer message, check result and user call in, actions out.

    ``already_delivered(producer_id, request_id)`` says a sample was delivered before this
    reader started, so a resend of it is acked and not delivered twice (R4).
    """

    def __init__(
        self,
        config: LedgerConfig | None = None,
        already_delivered: Callable[[str, str], bool] | None = None,
    ) -> None:
        self.config = config = config or LedgerConfig()
        self.stats = ReaderStats()
        self.producers = Producers()
        self._book = SampleBook(self._connected, config.quarantine_s, config.fence_bound_s)
        self._samples: dict[Key, SampleRecord] = self._book.samples
        # handed out (R4)
        self.delivered = Delivered(config.delivered_memory, already_delivered)
        self._refusals = Refusals(self._book, self.stats)
        # R12
        self.credits = Credits()
        # what the shells read
        self.view = LedgerView(self._book, self.producers, self.credits)

    # ------------------------------------------------------------------ pool
    def set_pages(self, page_bytes: int, num_pages: int) -> None:
        self._book.set_pages(page_bytes, num_pages)

    # ------------------------------------------------- the shells' own counts
    def refused_peer(self) -> None:
        """The serving thread refused a peer's connection or notification (protocol error)."""
        self.stats.refused += 1

    def values_checked(self, seconds: float) -> None:
        """A sample's states were checked for NaN/Inf and all-zero tokens."""
        self.stats.values_check_s += seconds

    def copied(self, seconds: float) -> None:
        """A sample was copied out of the pool."""
        self.stats.copy_s += seconds

    # ------------------------------------------------------------------ peers
    def peer_ready(self, peer: PeerId, hello: protocol.Hello) -> None:
        """A producer rank finished its handshake on connection ``peer``."""
        self.producers.ready(peer, hello)

    def peer_gone(self, peer: PeerId, now: float) -> list[Action]:
        """A connection closed; its rank's slot is free at once, so it may reconnect.

        Its samples are judged after a grace in which its last notifications may still
        arrive (R6). Settled at once when nothing of it is awaited."""
        ident = self.producers.identity(peer)
        if ident is None:
            return []
        awaited = self._book.awaited(*ident)
        self.producers.gone(peer, now + (self.config.grace_s if awaited else 0.0))
        self._book.page_fences.peer_gone(peer, now)
        # a WRITE into one may still land (R12)
        for g, credit in self.credits.of_peer(peer):
            self._credit_back(g, "", credit, None, now)
        return self._departed(now)

    def _departed(self, now: float) -> list[Action]:
        """Departures whose grace is over: when no rank of a producer is left, its
        incomplete samples are discarded (R6)."""
        actions: list[Action] = []
        for pid in self.producers.departed(now):
            self.credits.forget(pid)
            for s in self._book.incomplete_of(pid):
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
        assert self._book.pool is not None and self._book.page_bytes is not None
        s = self._samples.get(key)
        if s is None or self.delivered.known(key):
            answer = self._answer_instead(peer, m, key)
            if answer is not None:
                return answer
        if s is None and (over := self._over_pending_bound(pid, rank)) is not None:
            raise ProtocolError(over)
        if s is None:
            need = pages_for(m.geometry.sample_bytes(m.num_blocks), self._book.page_bytes)
            s = SampleRecord(key, m, prod.world_size, need)
            s.t_requested = now
            if not self.stats.first_request_t:
                self.stats.first_request_t = now
            try:
                self._book.admit(s)
            except PoolTooSmall as e:
                return self._refusals.pool_too_small(peer, m, e)
            self.credits.saw(pid, s.num_pages)
        elif s.manifest != m:
            raise ProtocolError(f"rank {rank} sent a manifest of {m.request_id} that differs from the first")
        if s.register(rank, peer, frozenset(req.blocks), current=self.producers.current(pid, rank)):
            self._book.promised(pid, rank)
        actions: list[Action] = []
        if s.pages is not None:
            actions.append(Send(peer, s.grant(rank)))
            actions += self._advance(s)
        return actions + self._grant(now)

    def placed(self, peer: PeerId, msg: protocol.Placed, now: float) -> list[Action]:
        """A producer of one rank placed a new sample at the start of a credit it holds (R12).

        Its WRITE is on its way, or landed already (its WriteDone kept with the credit). A
        sample refused here (delivered already, over a limit, not what the consumer
        expects) leaves the credit's pages waiting for that WRITE's fence."""
        pid, rank = self._ident(peer)
        m = msg.manifest
        key = (pid, m.request_id)
        credit = self.credits.take(peer, msg.generation)
        if credit is None:
            raise ProtocolError(f"{m.request_id} placed in credit {msg.generation}, which it does not hold")
        assert self._book.pool is not None and self._book.page_bytes is not None
        need = pages_for(m.geometry.sample_bytes(m.num_blocks), self._book.page_bytes)
        problem = None
        if need > len(credit.pages):
            problem = f"{m.request_id} needs {need} pages, placed in a credit of {len(credit.pages)}"
        elif key in self._samples:
            problem = f"{m.request_id} placed in a credit, but it was asked for before"
        else:
            problem = self._over_pending_bound(pid, rank)
        if problem is not None:
            self._credit_back(msg.generation, m.request_id, credit, None, now)
            raise ProtocolError(problem)
        refused = self._answer_instead(peer, m, key)
        if refused is not None:
            self._credit_back(msg.generation, m.request_id, credit, peer, now)
            return refused + self._grant(now)
        s = SampleRecord(key, m, 1, need)
        s.t_requested = now
        if not self.stats.first_request_t:
            self.stats.first_request_t = now
        self._book.place(s, ("credit", msg.generation), msg.generation, now)
        self.credits.saw(pid, need)
        self.credits.placed += 1
        if s.register(rank, peer, frozenset(msg.blocks), current=self.producers.current(pid, rank)):
            self._book.promised(pid, rank)
        # its WRITE is on its way: a fence is owed if the sample is dropped
        s.grant(rank)
        landed = self.write_done(peer, credit.early, now) if credit.early is not None else []
        return landed + self._grant(now)

    def _answer_instead(self, peer: PeerId, manifest: protocol.Manifest, key: Key) -> list[Action] | None:
        """What a new sample gets instead of pages, None if nothing: an Ack if it was
        delivered before (R4: never twice; none yet while its first ack is owed), a
        refusal if it is over the token limit or not what the consumer expects."""
        if self.delivered.known(key):
            self.stats.resends_acked += 1
            # its ack still awaited (manual mode): ack it then
            if self.delivered.resent(key, peer):
                return []
            return [Send(peer, protocol.Ack(request_id=manifest.request_id))]
        if manifest.num_tokens > self.config.max_sample_tokens:
            return self._refusals.over_limit(peer, manifest, self.config.max_sample_tokens)
        if self.config.expect is not None and (differs := self.config.expect.mismatches(manifest)):
            return self._refusals.mismatch(peer, manifest, differs)
        return None

    def _over_pending_bound(self, pid: str, rank: int) -> str | None:
        """Why a rank may not promise one more sample (a protocol error), None if it may."""
        bound = self.config.max_pending_per_rank
        if self._book.pending_of(pid, rank) < bound:
            return None
        return f"{pid}/rank{rank} has {bound} samples promised and not handed out: over its bound"

    def credit_returned(self, peer: PeerId, msg: protocol.CreditReturned, now: float) -> list[Action]:
        """A credit given back unused: its pages are the pool's again (R12)."""
        self._ident(peer)
        credit = self.credits.take(peer, msg.generation)
        if credit is None:
            raise ProtocolError(f"returned credit {msg.generation}, which it does not hold")
        if credit.early is not None:
            raise ProtocolError(f"returned credit {msg.generation}, into which it wrote")
        assert self._book.pool is not None
        self._book.pool.release(("credit", msg.generation), credit.pages)
        return self._grant(now)

    def _credit_back(
        self, generation: int, request_id: str, credit: HeldCredit, owed: PeerId | None, now: float
    ) -> None:
        """A credit's pages go back once no WRITE into them can land: at once if its WRITE
        landed, after ``owed``'s fence, or after a quarantine (no one left to fence it)."""
        assert self._book.pool is not None
        key = ("credit", generation)
        landed = credit.early is not None
        fences = self._book.page_fences
        if not landed and fences.wait(
            generation, request_id, credit.pages, {owed} if owed is not None else set(), owed is None, now
        ):
            self._book.pool.hand_over(key, ("fence", generation))
        else:
            self._book.pool.release(key, credit.pages)

    def write_done(self, peer: PeerId, msg: protocol.WriteDone, now: float = 0.0) -> list[Action]:
        """A rank's WRITE of its share landed: its notification arrived.

        One that names another grant than the sample's never lands on it (R3). It fences
        that grant, or names pages a late WRITE changed."""
        pid, _ = self._ident(peer)
        s = self._samples.get((pid, msg.request_id))
        # it overtook its Placed (R12)
        if s is None and self.credits.stash(peer, msg):
            return []
        if s is None or s.pages is None or s.generation != msg.generation:
            return self._late_write(peer, msg, now)
        s, share = self._share_of(peer, msg.request_id, "write_done")
        share.in_flight = False
        # a reconnected rank may land its share again into the same pages, also once the
        # sample is complete: the same bytes, the same checksum
        if s.state in (SampleState.CHECKED, SampleState.HANDED_OUT):
            return []
        if (
            msg.checksum is None
            and not msg.checksum_follows
            and share.blocks
            and self._requires_checksum(s.key[0])
        ):
            return self._refusals.unchecked(s, self._ident(peer)[1], now)
        share.land(msg)
        return self._advance(s)

    def late_checksum(self, peer: PeerId, msg: protocol.LateChecksum) -> list[Action]:
        """The checksum of a rank's share, sent after its WRITE was posted."""
        s, share = self._share_of(peer, msg.request_id, "late_checksum")
        return self._advance(s) if share.checksum_came(msg.checksum) else []

    def share_checked(
        self,
        key: Key,
        rank: int,
        landing: int,
        ok: bool,
        now: float,
        seconds: float = 0.0,
        screen: RowsScreen | None = None,
    ) -> list[Action]:
        """A ``CheckShare``'s result: it took ``seconds``, and ``screen`` is its rows' values screen.

        A share that matches is checked. One that does not is written again or, past
        ``max_rewrites``, its sample is refused (R5). One for an older landing, or for a
        sample gone meanwhile, is ignored; its time still counts."""
        self.stats.verify_s += seconds
        s = self._samples.get(key)
        share = s.shares.get(rank) if s is not None else None
        if s is None or share is None or share.landing != landing or share.checking != landing:
            return []
        share.checking = None
        if ok:
            share.checked, share.screen = True, screen
            return self._advance(s)
        return self._mismatch(s, rank, now)

    def producer_refused(self, peer: PeerId, msg: protocol.Refuse, now: float) -> list[Action]:
        """A producer gave up on one of its samples, e.g. its WRITE kept failing.

        Drop the sample, and tell its other ranks, whose shares can no longer complete it."""
        pid, rank = self._ident(peer)
        s = self._samples.get((pid, msg.request_id)) if msg.request_id else None
        label = f"{pid}/rank{rank}"
        if s is None or rank not in s.shares:
            return [Log("warning", f"{label} says: {msg.code} {msg.message}")]
        # complete and checked
        if s.state in (SampleState.CHECKED, SampleState.HANDED_OUT):
            return [
                Log("warning", f"{label} gave up on {msg.request_id}, which it had delivered: {msg.message}")
            ]
        return self._refusals.gave_up(s, rank, label, msg, now)

    def fenced(self, peer: PeerId, msg: protocol.Fenced, now: float) -> list[Action]:
        """A rank has no WRITE into a dropped sample's grant in flight any more (R3).

        A fence nothing waits for is moot: its sample landed, or its pages went back."""
        self._ident(peer)
        if not self._book.page_fences.answered(msg.generation, msg.request_id, peer):
            return []
        return self._page_fences_due(now)

    # ------------------------------------------------------------- the user
    def ready_sample(self, key: Key) -> ReadySample | None:
        """The sample as the user's thread hands it out, while it is CHECKED.

        None when it is not ready: discarded, or written again since it was queued."""
        s = self._samples.get(key)
        if s is None or s.state is not SampleState.CHECKED:
            return None
        assert s.pages is not None and self._book.page_bytes is not None
        screens = tuple(share.screen for share in s.shares.values())
        return ReadySample(key, s.manifest, s.pages.start * self._book.page_bytes, screens)

    def hand_out(self, key: Key, now: float) -> tuple[ReadySample, list[Action]] | None:
        """CHECKED -> HANDED_OUT: the user takes a ready sample on lease.

        It is remembered as delivered. Its producer is acked now (on take) or when the user
        acks (manual) (R4). None when it is not ready: discarded, or written again since it
        was queued."""
        ready = self.ready_sample(key)
        if ready is None:
            return None
        s, m = self._samples[key], ready.manifest
        move(s, SampleEvent.HANDED_OUT)
        s.t_handed_out = now
        self._book.settle_pending(s)
        nbytes = m.num_tokens * m.geometry.token_bytes
        self.stats.handed_out(key[0], m.num_tokens, nbytes, now - s.t_requested, now)
        self.delivered.remember(key, list(s.peers.values()))
        return ready, (self.ack(key) if self.config.ack_mode is AckMode.ON_TAKE else [])

    def release(self, key: Key, now: float) -> list[Action]:
        """HANDED_OUT -> released: the lease ended; its pages return to the pool (R3).
        Releasing a sample that is not on lease (released already) does nothing."""
        if not self._book.release(key):
            return []
        return self._grant(now)

    def ack(self, key: Key) -> list[Action]:
        """The user acknowledges a delivered sample: its producer's ranks get their Ack."""
        waiting = self.delivered.acked(key)
        return [Send(peer, protocol.Ack(request_id=key[1])) for peer in waiting or ()]

    def reject(self, key: Key, why: str, now: float) -> list[Action]:
        """The consumer will not take a sample (R11).

        A CHECKED sample (checked before hand-out) is refused, and its pages quarantined.
        For one HANDED_OUT and not acked yet (manual mode), its producer's ranks are refused
        instead of acked, and a resend is delivered again. Its producer fails the request
        with ``reader refused (rejected): why``."""
        s = self._samples.get(key)
        waiting = self.delivered.owed(key)
        if s is not None and s.state is SampleState.CHECKED:
            peers = list(s.peers.values())
        elif s is not None and s.state is SampleState.HANDED_OUT and waiting:
            peers = waiting
            self.delivered.forget(key)
        else:
            state = s.state.value if s is not None else "gone"
            raise IllegalSampleTransition(
                f"cannot reject {key[1]} of {key[0]}: {state}, or acknowledged already"
            )
        withdrawn = s if s.state is SampleState.CHECKED else None
        return self._refusals.rejected(key, withdrawn, peers, why, now)

    # ----------------------------------------------------------------- time
    def tick(self, now: float) -> list[Action]:
        """Fence waits that ended give their pages back; departures whose grace ended
        are settled; granted samples past their deadline are refused."""
        actions = self._departed(now)
        actions += self._refusals.expire(now, self.config.sample_timeout_s)
        return actions + self._page_fences_due(now)

    # -------------------------------------------------------------- helpers
    def _requires_checksum(self, producer_id: str) -> bool:
        if not self.config.verify or self.config.require_checksum is not RequireChecksum.AUTO:
            return self.config.verify and self.config.require_checksum is RequireChecksum.ALWAYS
        prod = self.producers.by_id.get(producer_id)
        return prod is None or prod.host_cache

    def _ident(self, peer: PeerId) -> tuple[str, int]:
        ident = self.producers.identity(peer)
        if ident is None:
            raise IllegalSampleTransition(f"peer {peer} is not a connected producer")
        return ident

    def _connected(self, peer: PeerId) -> bool:
        """Is ``peer`` its rank's connection now (not one departing)?"""
        ident = self.producers.identity(peer)
        return ident is not None and self.producers.current(*ident) == peer

    def _page_fences_due(self, now: float) -> list[Action]:
        """Dropped samples' pages whose fence wait is over go back; waiting samples get them."""
        due = self._book.page_fences_due(now)
        actions: list[Action] = [
            Log(
                "warning",
                f"pages of {w.request_id} (grant {g}) go back without a fence from its writer(s) "
                f"{sorted(w.owed)}; a WRITE of that grant landing later fails what holds them then",
            )
            for g, w, unfenced in due
            if unfenced
        ]
        return actions + (self._grant(now) if due else [])

    def _late_write(self, peer: PeerId, msg: protocol.WriteDone, now: float) -> list[Action]:
        """A WriteDone of a grant the sample no longer has (R3).

        It fences that grant's pages or, where they went back unfenced, fails what holds them now."""
        pid, rank = self._ident(peer)
        rid, g = msg.request_id, msg.generation
        label = f"a WRITE of {rid} by {pid}/rank{rank} (grant {g})"
        if self._book.page_fences.answered(g, rid, peer):
            dropped = Log("warning", f"{label} landed after its sample was dropped")
            return [dropped, *self._page_fences_due(now)]
        if self._book.page_fences.fenced(g, rid):
            # its fence came first: the WRITE had ended before it was sent
            return []
        pages = self._book.page_fences.unfenced(g, rid)
        if pages is None:
            raise ProtocolError(f"write_done for {rid}, which it was not granted (grant {g})")
        return self._refusals.overwritten(pages, label, now)

    def _share_of(self, peer: PeerId, request_id: str, what: str) -> tuple[SampleRecord, Share]:
        pid, rank = self._ident(peer)
        s = self._samples.get((pid, request_id))
        share = s.shares.get(rank) if s is not None else None
        if s is None or s.pages is None or share is None:
            raise ProtocolError(f"{what} for {request_id}, which it was not granted")
        return s, share

    def _grant(self, now: float) -> list[Action]:
        """Runs of pages to waiting samples in arrival order while the head fits (R1, R7)."""
        if self._book.pool is None:
            return []
        actions: list[Action] = []
        for s in self._book.grant(now):
            grant = s.grant()
            actions += [Send(peer, grant) for peer in s.peers.values()]
            actions += self._advance(s)
        actions += self._credits_ahead()
        self.stats.peak_pages_used = max(self.stats.peak_pages_used, self._book.pool.used_pages)
        return actions

    def _credits_ahead(self) -> list[Action]:
        """Credits to the producers that asked, while no sample waits for pages; recalled
        once one does (R12)."""
        pool = self._book.pool
        assert pool is not None
        if pool.waiting:
            return [Send(peer, protocol.CreditRecall(generation=g)) for g, peer in self.credits.to_recall()]
        actions: list[Action] = []
        for pid, prod in self.producers.by_id.items():
            peer = prod.ranks.get(0) if prod.credits_ahead and prod.world_size == 1 else None
            size = self.credits.size_for(pid) if peer is not None else None
            if peer is None or size is None:
                continue
            while self.credits.held_by(peer) < prod.credits_ahead:
                g = self._book.page_fences.new_generation()
                run = pool.take_now(("credit", g), size)
                if run is None:
                    return actions
                actions.append(Send(peer, self.credits.hold(g, peer, pid, run)))
        return actions

    def _advance(self, sample: SampleRecord) -> list[Action]:
        """Check every share that landed with its checksum known; move the sample on."""
        prod = self.producers.by_id.get(sample.key[0])
        kind = prod.checksum_kind if prod is not None else ShareChecksum.XXH3
        return sample.advance(self.config.verify, kind)

    def _mismatch(self, sample: SampleRecord, rank: int, now: float) -> list[Action]:
        m, key = sample.manifest, sample.key
        self.stats.checksum_mismatches += 1
        sample.rewrites += 1
        if sample.rewrites > self.config.max_rewrites:
            return self._refusals.checksum(sample, rank, now)
        # nobody left to write it again
        if key[0] not in self.producers:
            gone = Log("error", f"request {m.request_id}: a share failed its checksum")
            return [gone, *self._discard(sample, now, "its producer is gone")]
        sample.rewrite(rank)
        return [
            Log(
                "error",
                f"request {m.request_id} of producer {key[0]}: rank {rank}'s share does not match its "
                f"checksum; asking for it again ({sample.rewrites} of {self.config.max_rewrites})",
            ),
            Send(
                sample.shares[rank].peer,
                protocol.Rewrite(request_id=m.request_id, reason="the share does not match its checksum"),
            ),
        ]

    def _discard(self, sample: SampleRecord, now: float, why: str) -> list[Action]:
        return self._refusals.discard(sample, now, why)
