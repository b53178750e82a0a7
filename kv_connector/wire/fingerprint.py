"""Fingerprints: a share's integrity record from a few words of every token slot, taken
by the producer in the engine step that wrote the slot, and recomputed by the reader on
what landed.

For token ``t`` of a sample (its states a ``[layers, words]`` grid of 8-byte words, a
layer's row of ``hidden * itemsize`` bytes being a whole number of words: ``supported``)
the fingerprint samples ``K = layers + 2`` words (``coordinates``):

- one word of every captured layer, at a position that varies with the token (and so
  from block to block) and with the sample (``seed``, from its request id): any write
  of one whole token slot of any layer changes a sampled word unless it leaves that word
  as it was;
- word 0 of the first layer and the last word of the last layer: with the token slots of
  a block in order, the first and the last valid words of every block (a zeroed or
  truncated tail shows there), in either cache layout.

A share's record is XXH3-64 over the manifest's bytes, a tag, and the sampled words of
the share's valid tokens in order. It binds the manifest as the other checksums do.

Where it catches what a hash over both ends cannot: the producer takes its words in the
step whose forward pass wrote the slots (``gather``, torch where the cache is, no
host sync), from the slots the block table says, which the step's slot check compares
with the slot mapping the forward pass used. Blocks changed at any time after that
(reused, written late, a stale reference) and a block list at shipping time that is not
the one written no longer match. What it does not catch: a change that spares every
sampled word (one bit flipped on the link; RDMA's and PCIe's own CRCs cover that, and
the full checksums, ``integrity`` and ``block_digest``, remain as diagnostic modes).

Pure torch, numpy and xxhash; no nixl, vllm or sockets.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import xxhash

from kv_connector.wire.integrity import manifest_bytes
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.protocol import Manifest

TAG = b"kv_connector fingerprints v1"
WORD = 8  # bytes

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def supported(g: BlockLayout) -> bool:
    """Whether a token's row of one layer is a whole number of 8-byte words."""
    return g.row_bytes % WORD == 0


def seed_of(request_id: str) -> int:
    """A sample's seed: its request id's XXH3-64 (both ends have it)."""
    return xxhash.xxh3_64_intdigest(request_id.encode())


def _mix(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + _GOLD
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        out: np.ndarray = z ^ (z >> np.uint64(31))
        return out


def coordinates(
    seed: int | np.ndarray, positions: np.ndarray, layers: int, words: int
) -> tuple[np.ndarray, np.ndarray]:
    """(layer, word) of the ``K = layers + 2`` words sampled at each of a sample's token
    ``positions`` ``[n]`` (``seed``: the sample's, or each position's sample's ``[n]``):
    two ``[n, K]`` int64 arrays."""
    pos = np.asarray(positions, dtype=np.uint64)
    n = pos.shape[0]
    seeds = np.broadcast_to(np.asarray(seed, dtype=np.uint64).reshape(-1, 1), (n, 1))
    grid = pos[:, None] * np.uint64(layers) + np.arange(layers, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        mixed = _mix(grid ^ seeds)
    word = np.empty((n, layers + 2), dtype=np.int64)
    word[:, :layers] = (mixed % np.uint64(words)).astype(np.int64)
    word[:, layers] = 0
    word[:, layers + 1] = words - 1
    layer = np.empty((n, layers + 2), dtype=np.int64)
    layer[:, :layers] = np.arange(layers, dtype=np.int64)[None, :]
    layer[:, layers] = 0
    layer[:, layers + 1] = layers - 1
    return layer, word


def as_words(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., hidden]`` (its last dimension dense) as ``[..., words]`` of int64."""
    if (x.shape[-1] * x.element_size()) % WORD:
        raise ValueError(f"a row of {x.shape[-1]} x {x.element_size()} bytes is not a whole number of words")
    return x.view(torch.int64)


def gather(
    words: torch.Tensor, lead: tuple[torch.Tensor, ...], positions: np.ndarray, seed: int | np.ndarray
) -> torch.Tensor:
    """The sampled words ``[n, K]`` (int64, on ``words``'s device) of ``n`` token slots in
    ``words`` ``[..., layers, words]``: slot ``i`` at ``words[lead[0][i], lead[1][i], ...]``
    holds the sample's token ``positions[i]``. Only the ``n * K`` words are read, by one
    gather; nothing waits for the device."""
    layer, word = coordinates(seed, positions, words.shape[-2], words.shape[-1])
    dev = words.device
    at = (torch.from_numpy(layer).to(dev), torch.from_numpy(word).to(dev))
    return words[(*(t.to(dev)[:, None] for t in lead), *at)]


def share_tokens(m: Manifest, share: Iterable[int]) -> np.ndarray:
    """The valid token positions of a share's blocks (indices in the sample), in order."""
    bs = m.geometry.block_size
    parts = [np.arange(j * bs, min((j + 1) * bs, m.num_tokens), dtype=np.int64) for j in sorted(share)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def record(m: Manifest, share: Iterable[int], words: np.ndarray | torch.Tensor) -> int:
    """A share's fingerprint from the sampled words ``[n, K]`` of its valid tokens in order."""
    w = words.cpu().numpy() if isinstance(words, torch.Tensor) else words
    h = xxhash.xxh3_64(manifest_bytes(m))
    h.update(TAG)
    h.update(np.ascontiguousarray(w, dtype="<i8").tobytes())
    return h.intdigest()


def states_record(states: torch.Tensor, m: Manifest, share: Iterable[int]) -> int:
    """The share's fingerprint recomputed from a sample's ``[T, layers, hidden]`` view
    where it lies (the reader's pool, host or GPU): the words its tokens' slots hold now."""
    share = sorted(share)
    tokens = share_tokens(m, share)
    if not len(tokens):
        return record(m, share, np.zeros((0, m.num_layers + 2), dtype=np.int64))
    words = gather(as_words(states), (torch.from_numpy(tokens),), tokens, seed_of(m.request_id))
    return record(m, share, words)
