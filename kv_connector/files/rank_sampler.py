"""A batch sampler that keeps each trainer rank's rows across epochs, for the keep folder.

speculators' own sampler reshuffles every row across ranks each epoch, so a row kept on
one node is asked of another node's store the next epoch (and fetched from vLLM again);
this one splits the rows between ranks once, by seed, balanced by tokens, and reshuffles
only within each rank's share every epoch (as MosaicML Streaming keeps node-local shards
hot). DDP needs the same number of batches on every rank: a rank with fewer batches splits
its fullest ones, and where that is not enough repeats rows of its own.

Drop-in for speculators' ``MultipackDistributedBatchSamplerV2`` (same arguments, same
``set_epoch`` and ``_generate_batches`` its trainer uses to skip batches on resume); free
of speculators itself.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import numpy as np
from numpy.typing import ArrayLike, NDArray
from torch.utils.data import Sampler

from kv_connector.common.errors import ConfigurationError

Batch = NDArray[np.int64]


def partition(lengths: NDArray[np.int64], num_replicas: int, seed: int) -> list[Batch]:
    """Each rank's rows (sorted indices), fixed by ``seed`` alone: longest first (ties in
    a seeded order) to the rank with the fewest tokens so far, so the ranks' token counts
    differ by at most one row's (with fewer rows than ranks, some ranks get none)."""
    if num_replicas < 1:
        raise ConfigurationError(f"num_replicas must be at least 1, got {num_replicas}")
    order = np.random.default_rng(seed).permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    # (tokens, rows, rank)
    heap = [(0, 0, r) for r in range(num_replicas)]
    parts: list[list[int]] = [[] for _ in range(num_replicas)]
    for i in order:
        tokens, rows, r = heap[0]
        parts[r].append(int(i))
        heapq.heapreplace(heap, (tokens + int(lengths[i]), rows + 1, r))
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


def pack(rows: Batch, lengths: NDArray[np.int64], max_len: int) -> list[Batch]:
    """``rows`` in their order into batches of at most ``max_len`` tokens (a row opens a
    new batch where it does not fit the current one)."""
    batches: list[list[int]] = []
    fill = max_len + 1
    for i in rows:
        n = int(lengths[i])
        if fill + n > max_len:
            batches.append([])
            fill = 0
        batches[-1].append(int(i))
        fill += n
    return [np.array(b, dtype=np.int64) for b in batches]


def equalize(batches: list[Batch], target: int) -> list[Batch]:
    """``batches`` grown to ``target`` batches: the batch with the most rows split in two
    (in place, order kept) while one has two rows or more, then rows of these batches
    repeated one to a batch."""
    out = list(batches)
    while len(out) < target:
        widest = max(range(len(out)), key=lambda k: len(out[k]))
        if len(out[widest]) < 2:
            break
        half = len(out[widest]) // 2
        out[widest : widest + 1] = [out[widest][:half], out[widest][half:]]
    rows = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    for k in range(target - len(out)):
        out.append(rows[k % len(rows) : k % len(rows) + 1])
    return out


def epoch_batches(
    lengths: NDArray[np.int64], parts: list[Batch], max_len: int, seed: int, epoch: int
) -> list[list[Batch]]:
    """Every rank's batches for ``epoch``: its rows shuffled by (seed, epoch, rank),
    packed, and grown to the most batches any rank has; none on any rank where a rank has
    no rows (fewer rows than ranks: speculators' sampler drops them too)."""
    if any(len(rows) == 0 for rows in parts):
        return [[] for _ in parts]
    per_rank = []
    for r, rows in enumerate(parts):
        shuffled = rows[np.random.default_rng([seed, epoch, r]).permutation(len(rows))]
        per_rank.append(pack(shuffled, lengths, max_len))
    target = max(len(b) for b in per_rank)
    return [equalize(b, target) for b in per_rank]


class RankKeptBatchSampler(Sampler[Batch]):
    """Batches of row indices for ``rank`` of ``num_replicas``, the rank's rows the same
    every epoch (``partition``), shuffled within it each epoch (``set_epoch``); rows
    longer than ``batch_max_length`` count as that long (the collate truncates them), or
    are dropped with ``truncate_long_samples=False``; ``max_batches`` caps an epoch."""

    def __init__(
        self,
        batch_max_length: int,
        lengths: ArrayLike,
        num_replicas: int,
        rank: int,
        truncate_long_samples: bool = True,
        seed: int = 0,
        max_batches: int | None = None,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ConfigurationError(f"rank {rank} is not one of {num_replicas}")
        self.batch_max_length = batch_max_length
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.max_batches = max_batches
        self.epoch = 0
        all_lengths = np.asarray(lengths, dtype=np.int64)
        if truncate_long_samples:
            valid = np.arange(len(all_lengths))
            all_lengths = np.minimum(all_lengths, batch_max_length)
        else:
            valid = np.nonzero(all_lengths <= batch_max_length)[0]
        self.lengths = all_lengths
        parts = partition(all_lengths[valid], num_replicas, seed)
        # each rank's rows, as dataset indices
        self.parts = [valid[p] for p in parts]
        self._cached_generated_batches: tuple[int, list[Batch]] = (-1, [])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _generate_batches(self, epoch: int) -> list[Batch]:
        """This rank's batches for ``epoch`` (remembered for the epoch, as speculators'
        trainer expects when it skips batches on resume)."""
        if self._cached_generated_batches[0] == epoch:
            return self._cached_generated_batches[1]
        mine = epoch_batches(self.lengths, self.parts, self.batch_max_length, self.seed, epoch)[self.rank]
        if self.max_batches is not None:
            mine = mine[: self.max_batches]
        self._cached_generated_batches = (epoch, mine)
        return mine

    def __iter__(self) -> Iterator[Batch]:
        return iter(self._generate_batches(self.epoch))

    def __len__(self) -> int:
        return len(self._generate_batches(self.epoch))
