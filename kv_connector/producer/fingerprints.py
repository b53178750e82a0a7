"""The producer's fingerprints (``wire.fingerprint``), taken in the step that wrote the
slots: at the end of each step (``wait_for_save``, after the drafter) the worker side
gathers the sampled words of every position the step computed, from the slots the block
table gives them (the step's slot check holds those against the slot mapping the forward
pass used), with one torch gather where the cache is; on a GPU the words are copied to
pinned host memory asynchronously and an event recorded after the copy, on the engine's
stream, so the engine never waits. At ship time the words of a sample's tokens make each
share's record (``SampleWords.record``), read once the step is done.

A position no step of this request wrote (a prefix-cache hit: computed by an earlier
request, its block shared and never reused while referenced) is fingerprinted when the
sample ships, in the same hook, from the blocks it ships from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_connector.common.device import DeviceEvent, HostDone
from kv_connector.producer.planning import StepExpect
from kv_connector.sender.cache_blocks import CacheBlocks
from kv_connector.wire import fingerprint
from kv_connector.wire.protocol import Manifest


@dataclass
class _Taken:
    """One gather's words ``[n, layers]`` (on the host once ``done``), shared by the
    requests of its step."""

    words: torch.Tensor
    done: DeviceEvent


@dataclass
class _Chunk:
    positions: np.ndarray  # [n] the sample's token positions
    taken: _Taken
    start: int  # its rows in ``taken.words``
    sealed: bool  # taken knowing the sample's last position


@dataclass
class SampleWords:
    """One sample's fingerprint words, chunk by chunk as its steps took them."""

    seed: int
    chunks: list[_Chunk] = field(default_factory=list)
    next_position: int = 0  # positions 0 .. next_position - 1 taken, in order, so far
    out_of_order: bool = False
    sealed: bool = False  # its last position was taken knowing it is the last

    def add(self, chunk: _Chunk) -> None:
        p = chunk.positions
        if len(p) and int(p[0]) == self.next_position and int(p[-1]) == self.next_position + len(p) - 1:
            self.next_position += len(p)
        elif len(p):
            self.out_of_order = True
        self.sealed = self.sealed or chunk.sealed
        self.chunks.append(chunk)

    def gaps(self, num_tokens: int) -> np.ndarray:
        """The positions below ``num_tokens`` no step took words of."""
        if not self.out_of_order and self.next_position >= num_tokens:
            return np.zeros(0, dtype=np.int64)
        covered = [c.positions for c in self.chunks]
        have = np.unique(np.concatenate(covered)) if covered else np.zeros(0, dtype=np.int64)
        return np.setdiff1d(np.arange(num_tokens, dtype=np.int64), have, assume_unique=True)

    def words(self, positions: np.ndarray) -> np.ndarray:
        """``[n, layers]`` words of the sample's tokens at ``positions`` (a later step's
        words of a position written again win); waits for the steps that took them (done
        by the time a share is read: its gate opened). ValueError: a position without words."""
        if not len(positions):
            return np.zeros((0, 0), dtype=np.int64)
        top = int(positions.max()) + 1
        out: np.ndarray | None = None
        have = np.zeros(top, dtype=bool)
        for c in self.chunks:
            c.taken.done.synchronize()
            n = len(c.positions)
            w = c.taken.words.numpy()[c.start : c.start + n]
            keep = c.positions < top
            if out is None:
                out = np.zeros((top, w.shape[1]), dtype=np.int64)
            out[c.positions[keep]] = w[keep]
            have[c.positions[keep]] = True
        missing = positions[~have[positions]] if out is not None else positions
        if out is None or len(missing):
            raise ValueError(f"no fingerprint of token position {int(missing[0])}: no step wrote it")
        picked: np.ndarray = out[positions]
        return picked

    def record(self, m: Manifest, share: Iterable[int]) -> int:
        """The share's fingerprint (``wire.fingerprint.record``) from these words."""
        share = sorted(share)
        return fingerprint.record(m, share, self.words(fingerprint.share_tokens(m, share)))


class Fingerprints:
    """Every followed request's words, taken step by step from ``blocks``."""

    def __init__(self, blocks: CacheBlocks, block_size: int) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self._samples: dict[str, SampleWords] = {}

    def take(self, expect: StepExpect, last: Mapping[str, int] | None = None) -> None:
        """This step's positions (``expect``: where the step's slices were written), on
        the engine's thread after the drafter: one gather, nothing waits for the device.
        ``last``: the last position of each sample that ships in this step."""
        singles = expect.singles
        rids = [s[0] for s in singles]
        sizes = [1] * len(singles)
        pos = [np.fromiter((s[1] for s in singles), dtype=np.int64, count=len(singles))]
        blk = [np.fromiter((s[3] for s in singles), dtype=np.int64, count=len(singles))]
        bs = self.block_size
        for e in expect.spans:
            p = np.arange(e.start, e.start + e.num_tokens, dtype=np.int64)
            table = np.asarray(e.blocks, dtype=np.int64)
            rids.append(e.request_id)
            sizes.append(len(p))
            pos.append(p)
            blk.append(table[p // bs - e.first_block])
        if rids:
            self._gather(rids, sizes, np.concatenate(pos), np.concatenate(blk), last or {})

    def ship(self, request_id: str, num_tokens: int, blocks: Sequence[int]) -> SampleWords:
        """The sample's words, at its ship: positions no step wrote are taken now from the
        blocks it ships from, and its last token again when no step took it knowing it is
        the last (``wire.fingerprint``: the last word of a partly filled last block). The
        request is forgotten here."""
        sample = self._sample(request_id)
        gaps = sample.gaps(num_tokens)
        if num_tokens and not sample.sealed and (not len(gaps) or gaps[-1] != num_tokens - 1):
            gaps = np.append(gaps, num_tokens - 1)
        if len(gaps):
            table = np.asarray(blocks, dtype=np.int64)
            self._gather(
                [request_id], [len(gaps)], gaps, table[gaps // self.block_size], {request_id: num_tokens - 1}
            )
        return self._samples.pop(request_id)

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
        self,
        rids: list[str],
        sizes: list[int],
        positions: np.ndarray,
        blocks: np.ndarray,
        last: Mapping[str, int],
    ) -> None:
        samples = [self._sample(r) for r in rids]
        seeds = np.repeat(np.array([s.seed for s in samples], dtype=np.uint64), sizes)
        ends: int | np.ndarray = -1
        if last:
            ends = np.repeat(np.array([last.get(r, -1) for r in rids], dtype=np.int64), sizes)
        words = self.blocks.token_words(blocks, positions % self.block_size, positions, seeds, ends)
        done: DeviceEvent
        if words.is_cuda:
            host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
            host.copy_(words, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()  # on the engine's stream: after the step's drafter and this copy
            words, done = host, event
        else:
            done = HostDone()
        taken = _Taken(words, done)
        at = 0
        for rid, sample, n in zip(rids, samples, sizes, strict=True):
            p = positions[at : at + n]
            end = last.get(rid, -1)
            sample.add(_Chunk(p, taken, at, end >= 0 and bool(len(p)) and int(p[-1]) >= end))
            at += n
