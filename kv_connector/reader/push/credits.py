"""Credits ahead (protocol 16): runs of pages granted to a producer of one rank before any
sample of it needs them, so that its samples go out without a credit round trip.

The producer places its next new sample at the start of a credit (``Placed``) and posts
its WRITE at once; the pages of the run beyond the sample go back to the pool. A credit
given back unused (``CreditReturned``) goes back whole. One held by a connection that
closes waits a quarantine, since a WRITE into it may still land, as a departed writer's
grant does. Credits are granted only while no sample waits for pages (R7: no sample
waits behind them), and recalled (``CreditRecall``) once one does. Each is sized to the
largest of the producer's recent samples; a connection holds at most the number it asked
for in its Hello.

A WriteDone may overtake its Placed (the notification and the control connection are
separate paths): it is kept with its credit until the Placed comes. Pure logic: no nixl,
sockets, threads or clocks."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from kv_connector.reader.push.producers import PeerId
from kv_connector.wire import protocol

# samples of a producer whose sizes size its credits
RECENT = 16


@dataclass
class HeldCredit:
    """A run of pages a producer's connection holds, no sample placed in it yet."""

    peer: PeerId
    producer_id: str
    pages: range
    recalled: bool = False
    # a WriteDone into it that overtook its Placed
    early: protocol.WriteDone | None = None


class Credits:
    def __init__(self) -> None:
        # generation -> the credit
        self._held: dict[int, HeldCredit] = {}
        self._sizes: dict[str, collections.deque[int]] = {}
        # credits granted since the start
        self.granted = 0
        # samples placed in one
        self.placed = 0

    @property
    def pages_held(self) -> int:
        return sum(len(c.pages) for c in self._held.values())

    def size_for(self, producer_id: str) -> int | None:
        """Pages a new credit of ``producer_id`` gets: its largest recent sample's (None: none yet)."""
        recent = self._sizes.get(producer_id)
        return max(recent) if recent else None

    def saw(self, producer_id: str, num_pages: int) -> None:
        """A sample of ``producer_id`` needed ``num_pages`` pages."""
        self._sizes.setdefault(producer_id, collections.deque(maxlen=RECENT)).append(num_pages)

    def forget(self, producer_id: str) -> None:
        self._sizes.pop(producer_id, None)

    def held_by(self, peer: PeerId) -> int:
        return sum(c.peer == peer for c in self._held.values())

    def hold(self, generation: int, peer: PeerId, producer_id: str, pages: range) -> protocol.Credit:
        """``peer`` holds ``pages`` as credit ``generation``; the message that grants it."""
        self._held[generation] = HeldCredit(peer, producer_id, pages)
        self.granted += 1
        return protocol.Credit(generation=generation, first_page=pages.start, num_pages=len(pages))

    def take(self, peer: PeerId, generation: int) -> HeldCredit | None:
        """``peer``'s credit ``generation``, no longer held (placed or given back); None if
        it holds no such credit."""
        c = self._held.get(generation)
        if c is None or c.peer != peer:
            return None
        del self._held[generation]
        return c

    def stash(self, peer: PeerId, msg: protocol.WriteDone) -> bool:
        """A WriteDone naming a credit ``peer`` holds, before its Placed: kept for it (True)."""
        c = self._held.get(msg.generation)
        if c is None or c.peer != peer or c.early is not None:
            return False
        c.early = msg
        return True

    def to_recall(self) -> list[tuple[int, PeerId]]:
        """Every credit not recalled yet, now recalled: (generation, its holder)."""
        out = [(g, c.peer) for g, c in self._held.items() if not c.recalled]
        for g, _ in out:
            self._held[g].recalled = True
        return out

    def of_peer(self, peer: PeerId) -> list[tuple[int, HeldCredit]]:
        """The credits ``peer`` held, no longer held (its connection closed)."""
        out = [(g, c) for g, c in self._held.items() if c.peer == peer]
        for g, _ in out:
            del self._held[g]
        return out
