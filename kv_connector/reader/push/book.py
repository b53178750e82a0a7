"""The reader's books: every sample it holds by key, the pages they hold, and what they wait for.

The books hold the receive pool whose pages the samples hold (credits; ``pool/pages.py``),
and the fences its dropped samples' pages wait for (``page_fences.py``). They count how
many samples each producer rank has promised and not seen handed out (the bound of R9).
They answer the read-only queries (a sample's state, the leases, the pool by holder) and
move pages. Which transition happens, and when, is the ledger's (``ledger.py``). A sample
enters and leaves the books through the table of ``sample_states.py``. Pure logic."""

from __future__ import annotations

import collections
from collections.abc import Callable

from kv_connector.reader.pool.pages import PagePool
from kv_connector.reader.push.page_fences import PageFences, PageFenceWait
from kv_connector.reader.push.producers import PeerId
from kv_connector.reader.push.records import Key, SampleRecord
from kv_connector.reader.push.sample_states import (
    IllegalSampleTransition,
    SampleEvent,
    SampleState,
    begin,
    leave,
    move,
)
from kv_connector.reader.push.stats import PoolState


class SampleBook:
    def __init__(
        self, connected: Callable[[PeerId], bool], quarantine_s: float, fence_bound_s: float
    ) -> None:
        # is this connection its rank's current one?
        self._connected = connected
        self.page_fences = PageFences(quarantine_s, fence_bound_s)
        self.samples: dict[Key, SampleRecord] = {}
        self.pool: PagePool | None = None
        self.page_bytes: int | None = None
        # (producer, rank) -> its samples not handed out yet (the bound max_pending_per_rank)
        self._pending: collections.Counter[tuple[str, int]] = collections.Counter()

    def set_pages(self, page_bytes: int, num_pages: int) -> None:
        if self.pool is not None:
            raise IllegalSampleTransition("the pool's page size is decided once")
        self.page_bytes = page_bytes
        self.pool = PagePool(num_pages)

    # ---------------------------------------------------------------- queries
    def state_of(self, key: Key) -> SampleState | None:
        s = self.samples.get(key)
        return None if s is None else s.state

    def expecting_writes(self) -> bool:
        return any(s.state is SampleState.GRANTED for s in self.samples.values())

    def leases(self) -> list[SampleRecord]:
        out = [s for s in self.samples.values() if s.state is SampleState.HANDED_OUT]
        return sorted(out, key=lambda s: s.t_handed_out)

    def pool_state(self) -> PoolState:
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
            self.page_bytes,
            p.num_pages,
            p.free_pages,
            granted,
            leased,
            self.page_fences.pages_waiting,
            p.waiting,
        )

    def awaited(self, producer_id: str, rank: int) -> bool:
        """Is a WRITE of this producer rank awaited (granted, not landed)?"""
        for (pid, _request), s in self.samples.items():
            share = s.shares.get(rank) if pid == producer_id and s.pages is not None else None
            if share is not None and share.blocks and not share.landed:
                return True
        return False

    def incomplete_of(self, producer_id: str) -> list[SampleRecord]:
        """The producer's samples waiting for pages or for their shares."""
        waiting = (SampleState.PROMISED, SampleState.GRANTED)
        return [s for key, s in self.samples.items() if key[0] == producer_id and s.state in waiting]

    def late(self, now: float, timeout_s: float) -> list[SampleRecord]:
        """Granted samples not complete and checked ``timeout_s`` after their grant."""
        on_way = (SampleState.GRANTED, SampleState.WRITTEN)
        return [s for s in self.samples.values() if s.state in on_way and now - s.t_granted > timeout_s]

    def pending_of(self, producer_id: str, rank: int) -> int:
        return self._pending[(producer_id, rank)]

    # ---------------------------------------------------------------- changes
    def admit(self, sample: SampleRecord) -> None:
        """A new sample waits in the pool's FIFO for its run of pages.

        Raises ``PoolTooSmall`` when it can never fit; it is not admitted then."""
        assert self.pool is not None
        # the table first: nothing changed if it refuses
        begin(sample)
        self.pool.request(sample.key, sample.num_pages)
        self.samples[sample.key] = sample

    def place(self, sample: SampleRecord, credit: tuple[str, int], generation: int, now: float) -> None:
        """A new sample placed at the start of a credit's run (``credits.py``): it holds the
        run's first pages under that credit's generation, the rest go back to the pool."""
        assert self.pool is not None
        begin(sample)
        pages = self.pool.shrink(credit, sample.num_pages)
        self.pool.hand_over(credit, sample.key)
        move(sample, SampleEvent.GRANTED)
        sample.pages, sample.t_granted, sample.generation = pages, now, generation
        self.samples[sample.key] = sample

    def promised(self, producer_id: str, rank: int) -> None:
        """A rank registered its share of a sample not handed out yet."""
        self._pending[(producer_id, rank)] += 1

    def settle_pending(self, sample: SampleRecord) -> None:
        """The sample is handed out or gone: its ranks' promises are kept."""
        for rank in sample.shares:
            k = (sample.key[0], rank)
            self._pending[k] -= 1
            if self._pending[k] <= 0:
                del self._pending[k]

    def grant(self, now: float) -> list[SampleRecord]:
        """Runs of pages to waiting samples in arrival order while the head fits (R1, R7):
        PROMISED -> GRANTED."""
        if self.pool is None:
            return []
        granted = []
        for key, pages in self.pool.grantable():
            s = self.samples[key]  # type: ignore[index]
            move(s, SampleEvent.GRANTED)
            s.pages, s.t_granted, s.generation = pages, now, self.page_fences.new_generation()
            granted.append(s)
        return granted

    def release(self, key: Key) -> bool:
        """A lease ended: the sample's pages return to the pool (R3). False when it is
        not on lease."""
        s = self.samples.get(key)
        if s is None or s.state is not SampleState.HANDED_OUT:
            return False
        leave(s, SampleEvent.RELEASED)
        del self.samples[key]
        assert self.pool is not None and s.pages is not None
        self.pool.release(key, s.pages)
        return True

    def drop(self, sample: SampleRecord, now: float, event: SampleEvent) -> None:
        """The sample leaves the books before it was handed out; it no longer counts against its ranks (R9).

        ``event``: discarded, refused or rejected. Pages it was granted go back once no
        WRITE into them can land (R3, ``page_fences.py``), at once if none is on its way."""
        assert self.pool is not None
        leave(sample, event)
        del self.samples[sample.key]
        if sample.state is not SampleState.HANDED_OUT:
            self.settle_pending(sample)
        if sample.pages is None:
            self.pool.cancel(sample.key)
            return
        writing = [share.peer for share in sample.shares.values() if share.in_flight]
        owed = {peer for peer in writing if self._connected(peer)}
        departed = len(owed) < len(writing)
        if self.page_fences.wait(sample.generation, sample.key[1], sample.pages, owed, departed, now):
            self.pool.hand_over(sample.key, ("fence", sample.generation))
        else:
            self.pool.release(sample.key, sample.pages)

    def page_fences_due(self, now: float) -> list[tuple[int, PageFenceWait, bool]]:
        """Dropped samples' pages whose fence wait is over return to the pool.

        Each is (generation, wait, ended by the bound with a writer owing its fence)."""
        due = self.page_fences.due(now)
        for g, w, _ in due:
            assert self.pool is not None
            self.pool.release(("fence", g), w.pages)
        return due
