"""Push's fence on the reader's pages (R3): a dropped sample's pages wait until no WRITE can land.

The pages of a sample that leaves the books undelivered go back to the pool only once no
WRITE into them can still land. Every grant of pages has a generation, which each WRITE
into them names (``WriteDone.generation``). A rank that was sent the grant (or a Rewrite)
and whose WriteDone has not come is owed a fence. It answers ``Fenced`` once its job there
ended with no WRITE in flight, or its late WriteDone comes.

A rank whose connection is gone cannot answer. Its transport settles the WRITEs in flight
within the quarantine, so the pages wait that long. A rank that stays connected and never
answers is waited for at most ``bound_s``. Then the pages go back all the same, and the
grant is remembered as unfenced. A WriteDone of it arriving later names the pages a late
WRITE changed, and the ledger fails whatever holds them then.

A WriteDone of a grant fenced already is moot. A fence is sent only once the WRITE ended,
and its notification may come after it. Pure logic: no nixl, sockets, threads or clocks."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from kv_connector.reader.push.producers import PeerId

# grants whose wait ended, remembered for their late WriteDone
MEMORY = 4096


@dataclass
class PageFenceWait:
    """The pages of a dropped sample, waiting for its writers."""

    request_id: str
    pages: range
    # connected ranks whose WRITE may still land
    owed: set[PeerId]
    # not before this (0.0: no writer departed with a WRITE on its way)
    until: float
    # and not after this, fenced or not
    bound: float

    def over(self, now: float) -> bool:
        return (not self.owed and now >= self.until) or now >= self.bound


class PageFences:
    def __init__(self, quarantine_s: float, bound_s: float, memory: int = MEMORY) -> None:
        self.quarantine_s = quarantine_s
        self.bound_s = max(bound_s, quarantine_s)
        self._memory = memory
        # generation -> its wait
        self._waits: dict[int, PageFenceWait] = {}
        self._unfenced: collections.OrderedDict[int, tuple[str, range]] = collections.OrderedDict()
        self._fenced: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._next = 1

    def new_generation(self) -> int:
        """The generation of a new grant: never used before by this reader."""
        g, self._next = self._next, self._next + 1
        return g

    @property
    def pages_waiting(self) -> int:
        return sum(len(w.pages) for w in self._waits.values())

    def wait(
        self, generation: int, request_id: str, pages: range, owed: set[PeerId], departed: bool, now: float
    ) -> bool:
        """Hold ``pages`` of grant ``generation`` for ``owed``; False when nothing can land in them.

        A writer that ``departed`` adds a quarantine. On False, free the pages now."""
        if not owed and not departed:
            return False
        until = now + self.quarantine_s if departed else 0.0
        self._waits[generation] = PageFenceWait(request_id, pages, set(owed), until, now + self.bound_s)
        return True

    def answered(self, generation: int, request_id: str, peer: PeerId) -> bool:
        """``peer`` has nothing of grant ``generation`` (of ``request_id``) in flight any
        more; True if a wait owed it that."""
        w = self._waits.get(generation)
        if w is None or w.request_id != request_id or peer not in w.owed:
            return False
        w.owed.discard(peer)
        return True

    def peer_gone(self, peer: PeerId, now: float) -> None:
        """``peer``'s connection closed: what it owed waits a quarantine instead."""
        for w in self._waits.values():
            if peer in w.owed:
                w.owed.discard(peer)
                w.until = max(w.until, now + self.quarantine_s)

    def due(self, now: float) -> list[tuple[int, PageFenceWait, bool]]:
        """The waits that are over, removed: (generation, wait, ended by the bound with
        a writer still owing its fence)."""
        out = []
        for g, w in list(self._waits.items()):
            if w.over(now):
                del self._waits[g]
                unfenced = bool(w.owed)
                if unfenced:
                    self._unfenced[g] = (w.request_id, w.pages)
                    while len(self._unfenced) > self._memory:
                        self._unfenced.popitem(last=False)
                else:
                    self._fenced[g] = w.request_id
                    while len(self._fenced) > self._memory:
                        self._fenced.popitem(last=False)
                out.append((g, w, unfenced))
        return out

    def fenced(self, generation: int, request_id: str) -> bool:
        """Did grant ``generation`` of ``request_id`` go back fenced (its WRITEs ended)?"""
        return self._fenced.get(generation) == request_id

    def unfenced(self, generation: int, request_id: str) -> range | None:
        """The pages of a grant of ``request_id`` that went back unfenced (forgotten now):
        a WRITE of it landed there late."""
        got = self._unfenced.get(generation)
        if got is None or got[0] != request_id:
            return None
        del self._unfenced[generation]
        return got[1]
