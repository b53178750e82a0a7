"""What the push reader's ledger holds, read-only (``ReaderLedger.view``).

The shells ask it their questions: the serving thread (which samples are on lease, which
rank a peer is, whether a WRITE is expected), the checking thread (where a share lies),
the user's thread (what is ready) and the metrics (the pool's pages, the producers). It
changes nothing; the ledger alone moves samples. Pure, like the ledger; the caller holds
the reader's lock, as for the ledger."""

from __future__ import annotations

import dataclasses

from kv_connector.reader.pool.pages import PagePool
from kv_connector.reader.push.book import SampleBook
from kv_connector.reader.push.credits import Credits
from kv_connector.reader.push.producers import PeerId, Producers
from kv_connector.reader.push.records import CheckShare, Key, SampleRecord, ShareToCheck
from kv_connector.reader.push.sample_states import SampleState
from kv_connector.reader.push.stats import PoolState


class LedgerView:
    """The ledger's samples, pool, producers and credits, as the shells may read them."""

    def __init__(self, book: SampleBook, producers: Producers, credits: Credits) -> None:
        self._book = book
        self._producers = producers
        self._credits = credits

    @property
    def pool(self) -> PagePool | None:
        return self._book.pool

    @property
    def page_bytes(self) -> int | None:
        return self._book.page_bytes

    def state_of(self, key: Key) -> SampleState | None:
        return self._book.state_of(key)

    def generation_of(self, key: Key) -> int | None:
        """The generation of the sample's grant of pages, which each WRITE into them names."""
        sample = self._book.samples.get(key)
        return sample.generation if sample is not None and sample.generation else None

    def share_to_check(self, job: CheckShare) -> ShareToCheck | None:
        """Where the share a ``CheckShare`` names lies in the pool, or None if its check is moot.

        The checking thread reads the pool outside the lock, so it asks first whether the
        share is still this landing's. A newer landing queued its own check, and a dropped
        sample needs none."""
        sample = self._book.samples.get(job.key)
        share = sample.shares.get(job.rank) if sample is not None else None
        if sample is None or share is None or sample.pages is None or share.checking != job.landing:
            return None
        assert self.page_bytes is not None
        start = sample.pages.start * self.page_bytes
        return ShareToCheck(start, sample.manifest, tuple(sorted(share.blocks)))

    def world_of(self, producer_id: str) -> int | None:
        return self._producers.world_of(producer_id)

    def rank_connected(self, producer_id: str, rank: int) -> bool:
        return self._producers.rank_connected(producer_id, rank)

    def identity(self, peer: PeerId) -> tuple[str, int] | None:
        """(producer id, rank) of a connected or departing peer."""
        return self._producers.identity(peer)

    @property
    def expecting_writes(self) -> bool:
        """A granted sample waits for a WRITE (its writers need this side's progress)."""
        return self._book.expecting_writes()

    @property
    def departing(self) -> bool:
        return self._producers.departing

    def ready(self, producer_id: str | None = None) -> list[Key]:
        """Samples complete and checked, not yet handed out (of ``producer_id``, if given)."""
        verified = (k for k, s in self._book.samples.items() if s.state is SampleState.CHECKED)
        return [k for k in verified if producer_id is None or k[0] == producer_id]

    def leases(self) -> list[SampleRecord]:
        """The samples on lease to the user, oldest first."""
        return self._book.leases()

    def pool_state(self) -> PoolState:
        """The pool's pages by what holds them (for metrics and progress lines); credits
        ahead count as granted."""
        state = self._book.pool_state()
        return dataclasses.replace(state, granted=state.granted + self._credits.pages_held)

    def producers_connected(self) -> dict[str, int]:
        """Producer id -> how many of its ranks are connected."""
        return {pid: len(p.ranks) for pid, p in self._producers.by_id.items() if p.ranks}
