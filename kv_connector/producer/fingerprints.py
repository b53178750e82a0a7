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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kv_connector.common.device import DeviceEvent, HostDone
from kv_connector.producer.planning import StepExpect
from kv_connector.sender.cache_blocks import CacheBlocks
from kv_connector.wire import fingerprint
from kv_connector.wire.protocol import Manifest


@dataclass
class _Chunk:
    positions: np.ndarray  # [n] the sample's token positions
    words: torch.Tensor  # [n, layers] on the host once ``done``
    done: DeviceEvent


@dataclass
class SampleWords:
    """One sample's fingerprint words, chunk by chunk as its steps took them."""

    chunks: list[_Chunk] = field(default_factory=list)

    def covered(self) -> np.ndarray:
        """The positions some step took words of."""
        if not self.chunks:
            return np.zeros(0, dtype=np.int64)
        return np.unique(np.concatenate([c.positions for c in self.chunks]))

    def words(self, positions: np.ndarray) -> np.ndarray:
        """``[n, layers]`` words of the sample's tokens at ``positions`` (a later step's words of
        a position written again win); waits for the steps that took them (done by the
        time a share is read: its gate opened). ValueError: a position without words."""
        if not len(positions):
            return np.zeros((0, 0), dtype=np.int64)
        top = int(positions.max()) + 1
        out: np.ndarray | None = None
        have = np.zeros(top, dtype=bool)
        for c in self.chunks:
            c.done.synchronize()
            w = c.words.numpy()
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

    def take(self, expect: StepExpect) -> None:
        """This step's positions (``expect``: where the step's slices were written), on
        the engine's thread after the drafter: one gather, nothing waits for the device."""
        rids: list[str] = []
        sizes: list[int] = []
        pos, blk = [], []
        for rid, p1, _j, b in expect.singles:
            rids.append(rid)
            sizes.append(1)
            pos.append(np.array([p1], dtype=np.int64))
            blk.append(np.array([b], dtype=np.int64))
        bs = self.block_size
        for e in expect.spans:
            p = np.arange(e.start, e.start + e.num_tokens, dtype=np.int64)
            table = np.asarray(e.blocks, dtype=np.int64)
            rids.append(e.request_id)
            sizes.append(len(p))
            pos.append(p)
            blk.append(table[p // bs - e.first_block])
        if rids:
            self._gather(rids, sizes, np.concatenate(pos), np.concatenate(blk))

    def ship(self, request_id: str, num_tokens: int, blocks: Sequence[int]) -> SampleWords:
        """The sample's words, at its ship (in the step that wrote its last positions):
        positions no step wrote are taken now from the blocks it ships from, and its last
        token again, now that it is known to be the last (``wire.fingerprint``: the last
        word of a partly filled last block). The request is forgotten here."""
        sample = self._samples.get(request_id) or SampleWords()
        want = np.arange(num_tokens, dtype=np.int64)
        gaps = np.setdiff1d(want, sample.covered(), assume_unique=True)
        if num_tokens and (not len(gaps) or gaps[-1] != num_tokens - 1):
            gaps = np.append(gaps, num_tokens - 1)
        if len(gaps):
            table = np.asarray(blocks, dtype=np.int64)
            self._gather([request_id], [len(gaps)], gaps, table[gaps // self.block_size], num_tokens - 1)
            sample = self._samples[request_id]
        self._samples.pop(request_id, None)
        return sample

    def forget(self, request_id: str) -> None:
        self._samples.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._samples)

    def _gather(
        self, rids: list[str], sizes: list[int], positions: np.ndarray, blocks: np.ndarray, last: int = -1
    ) -> None:
        seeds = np.repeat(np.array([fingerprint.seed_of(r) for r in rids], dtype=np.uint64), sizes)
        words = self.blocks.token_words(blocks, positions % self.block_size, positions, seeds, last)
        done: DeviceEvent
        if words.is_cuda:
            host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
            host.copy_(words, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()  # on the engine's stream: after the step's drafter and this copy
            words, done = host, event
        else:
            done = HostDone()
        at = 0
        for rid, n in zip(rids, sizes, strict=True):
            chunk = _Chunk(positions[at : at + n], words[at : at + n], done)
            self._samples.setdefault(rid, SampleWords()).chunks.append(chunk)
            at += n
