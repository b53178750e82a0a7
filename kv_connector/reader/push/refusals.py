"""How the reader's ledger (``ledger.py``) ends a request or a sample that will not be delivered.

Once the ledger decided, this module makes the ``Refuse`` its producer's ranks get, with
the code and the reason: R5 checksum, R8 timeout, R9 limit, R10 unchecked, R11 rejected.
It discards the sample, holding its pages until no WRITE into them can land (R3, R6:
``page_fences.py``). It makes the log line and keeps the counts. Pure logic, part of the
reader's ledger."""


from __future__ import annotations

from kv_connector.reader.push.book import SampleBook
from kv_connector.reader.push.producers import PeerId
from kv_connector.reader.push.records import Action, Key, Log, SampleRecord, SampleState, Send
from kv_connector.reader.push.sample_states import SampleEvent
from kv_connector.reader.push.stats import ReaderStats
from kv_connector.wire import fields, protocol


class Refusals:
    def __init__(self, book: SampleBook, stats: ReaderStats) -> None:
        self._book = book
        self._stats = stats

    # ------------------------------------------------- requests (not admitted)
    def over_limit(self, peer: PeerId, manifest: protocol.Manifest, limit: int) -> list[Action]:
        """A sample over ``max_sample_tokens`` is refused alone (R9)."""
        self._stats.refused += 1
        self._stats.refused_limit += 1
        why = (
            f"request {manifest.request_id} has {manifest.num_tokens} tokens, "
            f"over this reader's limit of {limit}"
        )
        return [
            Send(peer, protocol.Refuse(code="limit", message=why, request_id=manifest.request_id)),
            Log("error", why),
        ]

    def mismatch(self, peer: PeerId, manifest: protocol.Manifest, differs: list[str]) -> list[Action]:
        """A sample other than the consumer expects (``ReaderConfig.expect``), refused
        before any of its bytes move."""
        self._stats.refused += 1
        self._stats.refused_mismatch += 1
        why = f"request {manifest.request_id} is not what this reader expects: {'; '.join(differs)}"
        refuse = protocol.Refuse(
            code="mismatch", message=fields.clip_text(why), request_id=manifest.request_id
        )
        return [Send(peer, refuse), Log("error", why)]

    def pool_too_small(self, peer: PeerId, manifest: protocol.Manifest, error: Exception) -> list[Action]:
        """A sample that needs more pages than the whole pool holds."""
        self._stats.refused += 1
        self._stats.refused_pool_too_small += 1
        refuse = protocol.Refuse(
            code="pool_too_small", message=fields.clip_text(str(error)), request_id=manifest.request_id
        )
        return [Send(peer, refuse), Log("error", f"request {manifest.request_id} refused: {error}")]

    # --------------------------------------------------- samples (admitted)
    def unchecked(self, sample: SampleRecord, rank: int, now: float) -> list[Action]:
        """``rank`` wrote its share without the checksum this reader requires (R10)."""
        self._stats.refused_unchecked += 1
        why = (
            f"rank {rank} of {sample.key[0]} wrote its share of {sample.key[1]} without the "
            "checksum this reader requires (the producer's checksum option is none; "
            "see --require-checksum)"
        )
        return self._refuse(sample, "unchecked", why, now, "unchecked")

    def checksum(self, sample: SampleRecord, rank: int, now: float) -> list[Action]:
        """A share failed its checksum more than ``max_rewrites`` times (R5)."""
        self._stats.refused_checksum += 1
        why = (
            f"request {sample.key[1]} of producer {sample.key[0]} failed its checksum "
            f"{sample.rewrites} times (rank {rank}); refusing it"
        )
        return self._refuse(sample, "checksum", why, now, "refused")

    def expire(self, now: float, timeout_s: float) -> list[Action]:
        """Granted samples not complete and checked ``timeout_s`` after their grant (R8)."""
        actions: list[Action] = []
        for s in self._book.late(now, timeout_s):
            self._stats.refused_timeout += 1
            why = (
                f"request {s.key[1]} of producer {s.key[0]} was not complete "
                f"{timeout_s:.0f} s after its pages were granted (ranks {s.missing()} missing)"
            )
            actions += self._refuse(s, "timeout", why, now, "timeout")
        return actions

    def overwritten(self, pages: range, label: str, now: float) -> list[Action]:
        """A late WRITE (``label``) landed in ``pages`` after they went back unfenced (R3).

        The samples there not handed out are refused; one on lease is named."""
        actions: list[Action] = [Log("error", f"{label} landed in pages {pages} after they went back")]
        for s in list(self._book.samples.values()):
            if s.pages is None or not set(s.pages) & set(pages):
                continue
            if s.state is SampleState.HANDED_OUT:
                actions.append(Log("error", f"sample {s.key[1]} of {s.key[0]}, on lease, may hold it"))
            else:
                why = f"request {s.key[1]} of {s.key[0]}: {label} landed in its pages"
                actions += self._refuse(s, "write_failed", why, now, "refused")
        return actions

    def gave_up(
        self, sample: SampleRecord, rank: int, label: str, msg: protocol.Refuse, now: float
    ) -> list[Action]:
        """Rank ``rank`` (``label``) of the sample's producer gave up on it; it is discarded.

        Its other ranks, whose shares can no longer complete it, are told."""
        actions: list[Action] = [
            Log("error", f"producer {label} gave up on {msg.request_id} ({msg.code}): {msg.message}")
        ]
        for r, other in sample.peers.items():
            if r != rank:
                refuse = protocol.Refuse(
                    code=msg.code,
                    message=fields.clip_text(f"rank {rank}: {msg.message}"),
                    request_id=msg.request_id,
                )
                actions.append(Send(other, refuse))
        return actions + self.discard(sample, now, f"{label} gave up on it")

    def rejected(
        self, key: Key, sample: SampleRecord | None, peers: list[PeerId], why: str, now: float
    ) -> list[Action]:
        """The consumer rejected a sample (R11): ``peers`` are refused.

        A sample not handed out yet (``sample``) leaves the books, its pages waiting for their fence."""
        self._stats.refused += 1
        refuse = protocol.Refuse(code="rejected", message=fields.clip_text(why), request_id=key[1])
        actions: list[Action] = [Log("error", f"rejected request {key[1]} of producer {key[0]}: {why}")]
        actions += [Send(peer, refuse) for peer in peers]
        if sample is not None:
            self._book.drop(sample, now, SampleEvent.REFUSED)
        return actions

    def discard(
        self, sample: SampleRecord, now: float, why: str, event: SampleEvent = SampleEvent.DISCARDED
    ) -> list[Action]:
        """The sample leaves the books undelivered (``event``: discarded, or refused) at
        ``now``; its pages wait for their fence."""
        self._book.drop(sample, now, event)
        self._stats.dropped += 1
        return [
            Log("warning", f"discarded incomplete sample {sample.key[1]} of producer {sample.key[0]} ({why})")
        ]

    def _refuse(
        self, sample: SampleRecord, code: protocol.RefuseCode, why: str, now: float, dropped: str
    ) -> list[Action]:
        """Refuse the sample to every rank of its producer, and discard it."""
        self._stats.refused += 1
        refuse = protocol.Refuse(code=code, message=why, request_id=sample.key[1])
        sends = [Send(p, refuse) for p in sample.peers.values()]
        return [Log("error", why), *sends, *self.discard(sample, now, dropped, SampleEvent.REFUSED)]
