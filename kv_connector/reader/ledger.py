"""The reader's sample ledger: every sample from its first credit request to its hand-out
(or its refusal or discard), the receive pool's pages, the connected producers, and the
samples already delivered. Pure logic (no nixl, sockets, threads or clocks: times are
passed in). The reader's shells (``server.py`` for the connections, ``core.py`` for the
user) feed it what happened and perform the actions it answers (``Send``, ``Ready``).
A peer's message that does not fit raises ``ProtocolError`` (the shell refuses that
peer, and only it); a transition the state does not allow raises ``IllegalTransition``.

States of a sample (``SampleState``), keyed by (producer id, request id):

    (credit request) ----------------> PROMISED   waits in the pool's FIFO for pages
    PROMISED   -- pages free --------> GRANTED    every rank's peer gets the Grant
    GRANTED    -- last share landed -> WRITTEN    every rank registered, every WRITE landed
    WRITTEN    -- take --------------> TAKEN      the user's get() verifies it
    TAKEN      -- shares match ------> VERIFIED
    TAKEN      -- a share mismatches > GRANTED    that rank writes it again (Rewrite)
    TAKEN      -- too many rewrites -> refused    never handed out; its producer is told
    VERIFIED   -- handed_out --------> released   pages back, producer acked (or, with
                                                  manual acks, when the user acks)
    PROMISED/GRANTED/WRITTEN -- producer gone or gave up --> discarded (pages quarantined)

A released sample is remembered (``delivered``): a producer that resends it after a
reconnect gets an Ack, never a second copy.

Invariants (tests name the one they prove):
  R1  No credit, no write: a producer may write a sample only into the pages granted
      to it; a page belongs to at most one sample at a time.
  R2  A sample is ready at most once per completion, and only when every rank of its
      producer registered its share, the shares tile the sample's blocks exactly, and
      every non-empty share's WRITE landed.
  R3  A sample's pages return to the pool only once it was copied out, or, for a sample
      that can never complete, after a quarantine, so a late WRITE lands unseen.
  R4  A producer is acked for a sample only once the sample is the consumer's (handed
      out, or acknowledged by the user in manual mode); a resend of a delivered sample
      is acked, never delivered twice.
  R5  A share that fails its checksum is written again at most ``max_rewrites`` times;
      then the sample is refused, its producer told, and it is never handed out.
  R6  When no rank of a producer is left (after a grace for notifications still on
      their way), its incomplete samples are discarded; a rank that reconnects resends
      into the same pages.
  R7  Samples are granted in arrival order (FIFO): a large sample is not starved.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from kv_connector import protocol
from kv_connector.layout import pages_per_block
from kv_connector.pool import PagePool, PoolTooSmall
from kv_connector.protocol import ProtocolError
from kv_connector.reader.producers import PeerId, Producers
from kv_connector.stats import ReaderStats

Key = tuple[str, str]  # (producer id, request id)

MAX_REWRITES = 3
QUARANTINE_S = 5.0  # pages of a discarded sample wait this long: a late WRITE lands unseen
LAST_NOTIFICATION_GRACE_S = 0.2  # how long a departed producer's last WriteDone may lag
DELIVERED_MEMORY = 100_000  # samples remembered for acking resends


class IllegalTransition(RuntimeError):
    """A shell asked for a transition the sample's state does not allow."""


class SampleState(enum.Enum):
    PROMISED = "promised"
    GRANTED = "granted"
    WRITTEN = "written"
    TAKEN = "taken"
    VERIFIED = "verified"


class AckMode(enum.Enum):
    ON_TAKE = "on_take"  # the producer is acked when the sample is handed out
    MANUAL = "manual"  # when the user calls ``ack`` (e.g. once it is durably written)


@dataclass(frozen=True)
class Send:
    peer: PeerId
    msg: protocol.Message


@dataclass(frozen=True)
class Ready:
    """A sample is complete: queue it for the user."""

    key: Key


@dataclass(frozen=True)
class Log:
    """Something worth a log line (the shell logs it at ``level``)."""

    level: str
    text: str


Action = Send | Ready | Log


@dataclass
class Sample:
    key: Key
    manifest: protocol.Manifest
    world_size: int
    state: SampleState = SampleState.PROMISED
    promised: dict[int, frozenset[int]] = field(default_factory=dict)  # rank -> its blocks
    written: set[int] = field(default_factory=set)  # ranks whose WRITE landed
    checksums: dict[int, int | None] = field(default_factory=dict)  # rank -> digest of its share
    peers: dict[int, PeerId] = field(default_factory=dict)  # rank -> its current connection
    pages: list[int] | None = None
    ppb: int = 1
    rewrites: int = 0

    def shares_landed(self) -> bool:
        if len(self.promised) < self.world_size or self.pages is None:
            return False
        return all(r in self.written or not b for r, b in self.promised.items())

    def share(self, rank: int) -> list[int]:
        return sorted(self.promised.get(rank, ()))


class ReaderLedger:
    def __init__(
        self,
        ack_mode: AckMode = AckMode.ON_TAKE,
        already_delivered: Callable[[str, str], bool] | None = None,
        max_rewrites: int = MAX_REWRITES,
        quarantine_s: float = QUARANTINE_S,
        grace_s: float = LAST_NOTIFICATION_GRACE_S,
        delivered_memory: int = DELIVERED_MEMORY,
    ) -> None:
        self.ack_mode = ack_mode
        self._already_delivered = already_delivered
        self.max_rewrites = max_rewrites
        self.quarantine_s = quarantine_s
        self.grace_s = grace_s
        self.delivered_memory = delivered_memory
        self.stats = ReaderStats()
        self.pool: PagePool | None = None
        self.page_bytes: int | None = None
        self.samples: dict[Key, Sample] = {}
        self.producers = Producers()
        # released samples -> the peers still owed an Ack ([] once acked)
        self.delivered: collections.OrderedDict[Key, list[PeerId]] = collections.OrderedDict()

    # ------------------------------------------------------------------ pool
    def set_pages(self, page_bytes: int, num_pages: int) -> None:
        if self.pool is not None:
            raise IllegalTransition("the pool's page size is decided once")
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
            key[0] == pid and s.pages is not None and s.promised.get(rank) and rank not in s.written
            for key, s in self.samples.items()
        )
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
        if s is None:
            s = Sample(key, m, prod.world_size, ppb=pages_per_block(m.block_bytes, self.page_bytes))
            try:
                self.pool.request(key, m.num_blocks * s.ppb)
            except PoolTooSmall as e:
                self.stats.refused += 1
                return [
                    Send(
                        peer, protocol.Refuse(code="pool_too_small", message=str(e), request_id=m.request_id)
                    ),
                    Log("error", f"request {m.request_id} refused: {e}"),
                ]
            self.samples[key] = s
        elif s.manifest != m:
            raise ProtocolError(f"rank {rank} sent a manifest of {m.request_id} that differs from the first")
        share = frozenset(req.blocks)
        if rank in s.promised:
            old = s.peers.get(rank)
            if old is not None and old != peer and self.producers.current(pid, rank) == old:
                raise ProtocolError(f"rank {rank} asked twice for {m.request_id}")
            if s.promised[rank] != share:
                raise ProtocolError(f"rank {rank} changed its share of {m.request_id}")
            # the rank reconnected: it resends into the same pages
        else:
            for r, other in s.promised.items():
                if share & other:
                    raise ProtocolError(f"ranks {r} and {rank} both promise blocks of {m.request_id}")
            s.promised[rank] = share
        s.peers[rank] = peer
        if len(s.promised) == s.world_size:
            covered = set().union(*s.promised.values())
            if len(covered) != m.num_blocks:
                raise ProtocolError(f"the ranks' shares of {m.request_id} leave blocks unwritten")
        actions: list[Action] = []
        if s.pages is not None:
            actions.append(Send(peer, self._grant_msg(s)))
            actions += self._maybe_written(s)
        return actions + self._grant()

    def write_done(self, peer: PeerId, msg: protocol.WriteDone) -> list[Action]:
        """A rank's WRITE of its share landed (its notification arrived)."""
        pid, rank = self._ident(peer)
        s = self.samples.get((pid, msg.request_id))
        if s is None or s.pages is None or rank not in s.promised:
            raise ProtocolError(f"write_done for {msg.request_id}, which it was not granted")
        # a reconnected rank may land its share again into the same pages, also once the
        # sample is complete: the same bytes, the same digest
        s.written.add(rank)
        s.checksums[rank] = msg.checksum
        return self._maybe_written(s)

    def producer_refused(self, peer: PeerId, msg: protocol.Refuse, now: float) -> list[Action]:
        """A producer gave up on one of its samples (e.g. its WRITE kept failing): drop the
        sample, and tell its other ranks, whose shares can no longer complete it."""
        pid, rank = self._ident(peer)
        s = self.samples.get((pid, msg.request_id)) if msg.request_id else None
        label = f"{pid}/rank{rank}"
        if s is None or rank not in s.promised:
            return [Log("warning", f"{label} says: {msg.code} {msg.message}")]
        if s.state in (SampleState.TAKEN, SampleState.VERIFIED):  # complete, being handed out
            return [
                Log("warning", f"{label} gave up on {msg.request_id}, which it had delivered: {msg.message}")
            ]
        actions: list[Action] = [
            Log("error", f"producer {label} gave up on {msg.request_id} ({msg.code}): {msg.message}")
        ]
        for r, other in s.peers.items():
            if r != rank:
                actions.append(
                    Send(
                        other,
                        protocol.Refuse(
                            code=msg.code,
                            message=f"rank {rank}: {msg.message}"[:4000],
                            request_id=msg.request_id,
                        ),
                    )
                )
        return actions + self._discard(s, now, f"{label} gave up on it")

    # ------------------------------------------------------------- the user
    def take(self, key: Key) -> Sample | None:
        """The user's get() takes a ready sample: WRITTEN -> TAKEN. None when it was
        discarded or rewritten since it was queued."""
        s = self.samples.get(key)
        if s is None or s.state is not SampleState.WRITTEN:
            return None
        s.state = SampleState.TAKEN
        return s

    def verified(self, key: Key, bad_ranks: list[int], now: float) -> list[Action]:
        """TAKEN -> VERIFIED when ``bad_ranks`` is empty; else the ranks whose share did
        not match their checksum write it again, or, past ``max_rewrites``, the sample is
        refused (R5)."""
        s = self._sample(key, SampleState.TAKEN)
        if not bad_ranks:
            s.state = SampleState.VERIFIED
            return []
        m = s.manifest
        self.stats.checksum_mismatches += len(bad_ranks)
        s.rewrites += 1
        ranks = ", ".join(str(r) for r in bad_ranks)
        if s.rewrites > self.max_rewrites:
            why = (
                f"request {m.request_id} of producer {key[0]} failed its checksum "
                f"{s.rewrites} times (rank {ranks}); refusing it"
            )
            self.stats.refused += 1
            actions: list[Action] = [Log("error", why)]
            actions += [
                Send(peer, protocol.Refuse(code="checksum", message=why, request_id=m.request_id))
                for peer in s.peers.values()
            ]
            return actions + self._discard(s, now, "refused")
        if key[0] not in self.producers:  # nobody left to write it again
            gone = Log("error", f"request {m.request_id}: a share failed its checksum")
            return [gone, *self._discard(s, now, "its producer is gone")]
        s.state = SampleState.GRANTED
        actions = [
            Log(
                "error",
                f"request {m.request_id} of producer {key[0]}: rank {ranks}'s share does not match its "
                f"checksum; asking for it again ({s.rewrites} of {self.max_rewrites})",
            )
        ]
        for rank in bad_ranks:
            s.written.discard(rank)
            writer = s.peers.get(rank)
            if writer is not None:
                actions.append(
                    Send(
                        writer,
                        protocol.Rewrite(
                            request_id=m.request_id, reason="the share does not match its checksum"
                        ),
                    )
                )
        return actions

    def handed_out(self, key: Key, nbytes: int) -> list[Action]:
        """VERIFIED -> released: the sample was copied out. Its pages return to the pool
        (R3), it is remembered as delivered, and its producer is acked now (on take) or
        when the user acks (manual) (R4)."""
        s = self._sample(key, SampleState.VERIFIED)
        del self.samples[key]
        assert self.pool is not None and s.pages is not None
        self.pool.release(key, s.pages)
        self.stats.samples += 1
        self.stats.bytes += nbytes
        self.delivered[key] = list(s.peers.values())
        while len(self.delivered) > self.delivered_memory:
            self.delivered.popitem(last=False)
        actions: list[Action] = self.ack(key) if self.ack_mode is AckMode.ON_TAKE else []
        return actions + self._grant()

    def ack(self, key: Key) -> list[Action]:
        """The user acknowledges a delivered sample: its producer's ranks get their Ack."""
        waiting = self.delivered.get(key)
        if waiting is None:
            return []
        self.delivered[key] = []  # acked: a resend of it is acked at once
        return [Send(peer, protocol.Ack(request_id=key[1])) for peer in waiting]

    # ----------------------------------------------------------------- time
    def tick(self, now: float) -> list[Action]:
        """Quarantines that ended give their pages back; departures whose grace ended
        are settled."""
        actions = self._departed(now)
        if self.pool is not None and self.pool.end_quarantines(now):
            actions += self._grant()
        return actions

    # -------------------------------------------------------------- helpers
    def _ident(self, peer: PeerId) -> tuple[str, int]:
        ident = self.producers.identity(peer)
        if ident is None:
            raise IllegalTransition(f"peer {peer} is not a connected producer")
        return ident

    def _sample(self, key: Key, state: SampleState) -> Sample:
        s = self.samples.get(key)
        if s is None or s.state is not state:
            raise IllegalTransition(f"sample {key} is {s.state.value if s else 'unknown'}, not {state.value}")
        return s

    def _grant_msg(self, s: Sample) -> protocol.Grant:
        assert s.pages is not None
        return protocol.Grant(request_id=s.manifest.request_id, pages=s.pages, pages_per_block=s.ppb)

    def _grant(self) -> list[Action]:
        """Pages to waiting samples in arrival order while the head fits (R1, R7)."""
        if self.pool is None:
            return []
        actions: list[Action] = []
        for key, pages in self.pool.grantable():
            s = self.samples[key]  # type: ignore[index]
            s.pages = pages
            s.state = SampleState.GRANTED
            grant = self._grant_msg(s)
            actions += [Send(peer, grant) for peer in s.peers.values()]
            actions += self._maybe_written(s)
        return actions

    def _maybe_written(self, s: Sample) -> list[Action]:
        if s.state is SampleState.GRANTED and s.shares_landed():
            s.state = SampleState.WRITTEN
            return [Ready(s.key)]
        return []

    def _discard(self, s: Sample, now: float, why: str) -> list[Action]:
        assert self.pool is not None
        del self.samples[s.key]
        if s.pages is None:
            self.pool.cancel(s.key)
        else:
            self.pool.quarantine(s.key, s.pages, now + self.quarantine_s)
        return [Log("warning", f"discarded incomplete sample {s.key[1]} of producer {s.key[0]} ({why})")]
