"""The producers a reader knows: the connection of each producer rank, the world size a
producer announced, and the departures of connections that closed while notifications
of theirs may still be on their way. Pure logic (part of the reader's ledger)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_connector.wire import protocol
from kv_connector.wire.protocol import ProtocolError, ShareChecksum

PeerId = int


@dataclass
class Producer:
    """A connected producer: its world size, the connection of each of its ranks, and
    whether its cache is in host memory (it then hashes cheaply: checksums required), and
    how its shares' checksums are computed (over bytes, or over block digests)."""

    world_size: int
    ranks: dict[int, PeerId] = field(default_factory=dict)
    host_cache: bool = True
    checksum_kind: ShareChecksum = ShareChecksum.XXH3
    # credits its one rank asked for (0 for a producer of more ranks)
    credits_ahead: int = 0


@dataclass
class Departure:
    peer: PeerId
    producer_id: str
    rank: int
    until: float


class Producers:
    def __init__(self) -> None:
        self.by_id: dict[str, Producer] = {}
        self._peer_rank: dict[PeerId, tuple[str, int]] = {}
        self._departures: list[Departure] = []

    def __contains__(self, producer_id: str) -> bool:
        return producer_id in self.by_id

    def world_of(self, producer_id: str) -> int | None:
        p = self.by_id.get(producer_id)
        return None if p is None else p.world_size

    def rank_connected(self, producer_id: str, rank: int) -> bool:
        p = self.by_id.get(producer_id)
        return p is not None and rank in p.ranks

    def current(self, producer_id: str, rank: int) -> PeerId | None:
        """The connection rank ``rank`` of the producer has now."""
        p = self.by_id.get(producer_id)
        return None if p is None else p.ranks.get(rank)

    def identity(self, peer: PeerId) -> tuple[str, int] | None:
        """(producer id, rank) of a connected or departing peer."""
        return self._peer_rank.get(peer)

    @property
    def departing(self) -> bool:
        return bool(self._departures)

    def ready(self, peer: PeerId, hello: protocol.Hello) -> Producer:
        """A producer rank finished its handshake on connection ``peer``."""
        if self.rank_connected(hello.producer_id, hello.rank):
            raise ProtocolError(f"producer {hello.producer_id} rank {hello.rank} is already connected")
        prod = self.by_id.setdefault(hello.producer_id, Producer(hello.world_size))
        if prod.world_size != hello.world_size:
            raise ProtocolError(
                f"producer {hello.producer_id} said world size {prod.world_size} before, "
                f"now {hello.world_size}"
            )
        prod.ranks[hello.rank] = peer
        prod.host_cache = hello.cache_mem == "DRAM"
        prod.checksum_kind = hello.checksum_kind
        prod.credits_ahead = hello.credits_ahead if hello.world_size == 1 else 0
        self._peer_rank[peer] = (hello.producer_id, hello.rank)
        return prod

    def gone(self, peer: PeerId, until: float) -> None:
        """Connection ``peer`` closed: its rank's slot is free at once; the peer itself is
        known until ``until`` (its last notifications may still arrive)."""
        ident = self._peer_rank.get(peer)
        if ident is None:
            return
        pid, rank = ident
        prod = self.by_id.get(pid)
        if prod is not None and prod.ranks.get(rank) == peer:
            del prod.ranks[rank]
        self._departures.append(Departure(peer, pid, rank, until))

    def settle(self, peer: PeerId, now: float) -> None:
        """End a departure now (its agent came back on a new connection)."""
        for d in self._departures:
            if d.peer == peer:
                d.until = now

    def departed(self, now: float) -> list[str]:
        """Forget the peers whose departure is over; returns the producers none of whose
        ranks is left (they are forgotten too)."""
        due = [d for d in self._departures if d.until <= now]
        self._departures = [d for d in self._departures if d.until > now]
        empty = []
        for d in due:
            self._peer_rank.pop(d.peer, None)
            prod = self.by_id.get(d.producer_id)
            if prod is not None and not prod.ranks:
                del self.by_id[d.producer_id]
                empty.append(d.producer_id)
        return empty

    def forgotten(self, peer: PeerId) -> bool:
        return peer not in self._peer_rank
