"""The producer's fingerprints (``wire.fingerprint``), taken in the step that wrote the slots.

They are taken where the cache is and copied off asynchronously, so the engine never waits.
At the end of each step (``wait_for_save``, after the drafter) the worker side gathers the
sampled words of every position the step computed. One torch gather reads them from the
slots the block table gives; the step's slot check holds those slots against the forward
pass's slot mapping. On a GPU the words are copied to pinned host memory without blocking,
and an event is recorded after the copy on the engine's stream. At ship time the words of a
sample's tokens make each share's record (``SampleWords.record``), read once the step is done.

A position no step of this request wrote is fingerprinted when the sample ships, in the same
hook, from the blocks it ships from. Such a position is a prefix-cache hit: an earlier request
computed it, and its block is shared and never reused while referenced.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np
import torch

from kv_connector.cache.blocks import CacheBlocks
from kv_connector.common.device import DeviceEvent, HostDone
from kv_connector.common.errors import IntegrityError
from kv_connector.producer.planning import StepSlots
from kv_connector.wire import fingerprint
from kv_connector.wire.protocol import Manifest


@dataclass
class _Taken:
    """One gather's words ``[n, layers]`` (on the host once ``done``), shared by the
    requests of its step; set once the gather is queued (its samples are told first, so
    a gather that failed leaves them None)."""

    words: torch.Tensor | None = None
    done: DeviceEvent | None = None


class SampleWords:
    """One sample's fingerprint words, run by run as its steps took them: each run the
    rows ``row .. row + n - 1`` of one gather, holding positions ``first .. first + n - 1``."""

    __slots__ = ("chunks", "next_position", "out_of_order", "sealed", "seed")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        # (gather, row, first, n)
        self.chunks: list[tuple[_Taken, int, int, int]] = []
        # positions 0 .. next_position - 1 taken, in order, so far
        self.next_position = 0
        self.out_of_order = False
        # its last position was taken knowing it is the last
        self.sealed = False

    def add(self, taken: _Taken, row: int, first: int, count: int, sealed: bool) -> None:
        if first == self.next_position:
            self.next_position += count
        else:
            self.out_of_order = True
        self.sealed = self.sealed or sealed
        self.chunks.append((taken, row, first, count))

    def gaps(self, num_tokens: int) -> np.ndarray:
        """The positions below ``num_tokens`` no step took words of."""
        if not self.out_of_order and self.next_position >= num_tokens:
            return np.zeros(0, dtype=np.int64)
        have = np.zeros(num_tokens, dtype=bool)
        for _, _, first, n in self.chunks:
            have[first : first + n] = True
        return np.flatnonzero(~have).astype(np.int64)

    def words(self, positions: np.ndarray) -> np.ndarray:
        """``[n, layers]`` words of the sample's tokens at ``positions``.

        A position written again takes the later step's words. It waits for the steps that
        took them, which are done by the time a share is read (its gate opened).
        ValueError: a position without words."""
        if not len(positions):
            return np.zeros((0, 0), dtype=np.int64)
        top = int(positions.max()) + 1
        out: np.ndarray | None = None
        have = np.zeros(top, dtype=bool)
        for taken, row, first, n in self.chunks:
            if first >= top or taken.words is None or taken.done is None:
                # a gather that failed gave no words: its positions are missing
                continue
            taken.done.synchronize()
            k = min(n, top - first)
            w = taken.words.numpy()[row : row + k]
            if out is None:
                out = np.zeros((top, w.shape[1]), dtype=np.int64)
            out[first : first + k] = w
            have[first : first + k] = True
        missing = positions[~have[positions]] if out is not None else positions
        if out is None or len(missing):
            raise IntegrityError(f"no fingerprint of token position {int(missing[0])}: no step wrote it")
        picked: np.ndarray = out[positions]
        return picked

    def record(self, manifest: Manifest, share: Iterable[int]) -> int:
        """The share's fingerprint (``wire.fingerprint.record``) from these words."""
        share = sorted(share)
        return fingerprint.record(manifest, share, self.words(fingerprint.share_tokens(manifest, share)))


# (request id, first position, how many)
Run = tuple[str, int, int]
# (request id, its tokens, the blocks it ships from)
Ship = tuple[str, int, Sequence[int]]


class Fingerprints:
    """Every followed request's words, taken step by step from ``blocks``."""

    def __init__(self, blocks: CacheBlocks, block_size: int) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self._samples: dict[str, SampleWords] = {}

    def take(self, planned: StepSlots, last: Mapping[str, int] | None = None) -> None:
        """Takes this step's positions, on the engine's thread after the drafter.

        One gather, and nothing waits for the device. ``planned``: where the step's slices
        were written. ``last``: the last position of each sample that ships in this step."""
        singles = planned.singles
        # a decode step's one-position slices, as columns: (request ids, positions, _, blocks)
        rids, firsts, _, cache_blocks = zip(*singles, strict=True) if singles else ((), (), (), ())
        runs: list[Run] = []
        pos = [np.array(firsts, dtype=np.int64)]
        blk = [np.array(cache_blocks, dtype=np.int64)]
        bs = self.block_size
        for e in planned.spans:
            # the positions its table covers (the slot check fails the rest by name)
            n = min(e.num_tokens, (e.first_block + len(e.blocks)) * bs - e.start)
            if n <= 0:
                continue
            p = np.arange(e.start, e.start + n, dtype=np.int64)
            runs.append((e.request_id, e.start, n))
            pos.append(p)
            blk.append(np.asarray(e.blocks, dtype=np.int64)[p // bs - e.first_block])
        if rids or runs:
            # rids and firsts: one zip's
            singles_as_runs = zip(rids, firsts, repeat(1), strict=False)
            self._gather(chain(singles_as_runs, runs), np.concatenate(pos), np.concatenate(blk), last or {})

    def ship(self, request_id: str, num_tokens: int, blocks: Sequence[int]) -> SampleWords:
        """The sample's words at its ship; the request is forgotten here.

        Positions no step wrote are taken now, from the blocks it ships from. Its last token
        is taken again when no step took it knowing it is the last. ``wire.fingerprint``
        treats that word apart: it is the last of a partly filled last block."""
        got = self.ship_many([(request_id, num_tokens, blocks)])[request_id]
        if isinstance(got, Exception):
            raise got
        return got

    def ship_many(self, orders: Sequence[Ship]) -> dict[str, SampleWords | Exception]:
        """``ship`` for each of a step's samples, with one gather for them all.

        A ship's gather is mostly numpy's and torch's fixed cost per call. Every sample pays
        one, since a step never knows its last token is the last: the sampler decides after
        it. A sample whose words cannot be taken gets its error and is forgotten; the others
        ship."""

        due: list[tuple[str, np.ndarray, np.ndarray]] = []
        out: dict[str, SampleWords | Exception] = {}
        for rid, num_tokens, blocks in orders:
            sample = self._sample(rid)
            gaps = sample.gaps(num_tokens)
            if num_tokens and not sample.sealed and (not len(gaps) or gaps[-1] != num_tokens - 1):
                gaps = np.append(gaps, num_tokens - 1)
            if not len(gaps):
                continue
            table = np.asarray(blocks, dtype=np.int64)
            if int(gaps[-1]) // self.block_size >= len(table):
                out[rid] = IntegrityError(f"{len(table)} blocks do not hold token position {int(gaps[-1])}")
                continue
            due.append((rid, gaps, table[gaps // self.block_size]))
        ends = {rid: n - 1 for rid, n, _ in orders}
        try:
            self._gather_due(due, ends)
        except Exception:
            # which of them: each alone
            for one in due:
                try:
                    self._gather_due([one], ends)
                except Exception as e:
                    out[one[0]] = e
        for rid, _, _ in orders:
            shipped = self._samples.pop(rid, None)
            if shipped is not None and rid not in out:
                out[rid] = shipped
        return out

    def _gather_due(self, due: Sequence[tuple[str, np.ndarray, np.ndarray]], ends: Mapping[str, int]) -> None:
        """One gather of the positions (and their blocks) ``due`` of each sample, in runs."""
        if not due:
            return
        runs: list[Run] = []
        for rid, gaps, _ in due:
            # runs of consecutive positions
            cuts = np.flatnonzero(np.diff(gaps) != 1) + 1
            runs.extend((rid, int(r[0]), len(r)) for r in np.split(gaps, cuts))
        positions = np.concatenate([g for _, g, _ in due])
        blocks = np.concatenate([b for _, _, b in due])
        self._gather(runs, positions, blocks, {rid: ends[rid] for rid, _, _ in due})

    def taken(self, request_id: str) -> SampleWords | None:
        """The words taken so far of a followed request (None: none)."""
        return self._samples.get(request_id)

    def forget(self, request_id: str) -> None:
        self._samples.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._samples)

    def _sample(self, rid: str) -> SampleWords:
        sample = self._samples.get(rid)
        if sample is None:
            sample = self._samples[rid] = SampleWords(fingerprint.seed_of(rid))
        return sample

    def _gather(
        self, runs: Iterable[Run], positions: np.ndarray, blocks: np.ndarray, last: Mapping[str, int]
    ) -> None:
        """One gather of ``positions`` (in ``blocks``), run after run (a decode step's are of
        one position each). Each sample is told its rows as its seed is read, in one pass over
        the requests. ``last``: the last position of each sample that ships now."""
        taken = _Taken()
        samples, make = self._samples, SampleWords
        seeds: list[int] = []
        ends: list[int] = []
        sizes: list[int] = []
        row = 0
        for rid, first, n in runs:
            sample = samples.get(rid)
            if sample is None:
                sample = samples[rid] = make(fingerprint.seed_of(rid))
            seeds.append(sample.seed)
            end = last.get(rid, -1) if last else -1
            ends.append(end)
            sizes.append(n)
            sample.add(taken, row, first, n, first <= end < first + n)
            row += n
        seed = np.array(seeds, dtype=np.uint64)
        end_of: int | np.ndarray = np.array(ends, dtype=np.int64) if last else -1
        # a run of several positions: each position its sample's
        if row != len(sizes):
            seed = np.repeat(seed, sizes)
            if last:
                end_of = np.repeat(end_of, sizes)
        words = self.blocks.token_words(blocks, positions % self.block_size, positions, seed, end_of)
        done: DeviceEvent
        if words.is_cuda:
            host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
            host.copy_(words, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            # on the engine's stream: after the step's drafter and this copy
            event.record()
            words, done = host, event
        else:
            done = HostDone()
        taken.words, taken.done = words, done
