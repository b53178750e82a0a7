"""Fingerprints: a share's integrity record from a few words of every token slot.

The producer takes them in the engine step that wrote the slot, and the reader recomputes
them on what landed. A layer's row must be a whole number of 8-byte words
(``block_digest.supported``). For each token the fingerprint samples one word of every
captured layer (``coordinates``). The word's position varies with the token's offset in its
block, from block to block, and from sample to sample (``seed``, from its request id). So any
write of one whole token slot changes a sampled word unless it leaves that word as it was.

At the edges of every block the position is fixed instead. A block's first token samples
word 0 of the first layer; its last token, and the sample's last, sample the last word of
the last layer. Those are the first and last valid words of every block in either layout,
where a zeroed or truncated tail shows.

A share's record is XXH3-64 over the manifest's bytes, a tag, and the sampled words of its
valid tokens in order. It binds the manifest as the other checksums do.

It catches what a hash over both ends cannot. The producer takes its words in the step whose
forward pass wrote the slots (``gather``, where the cache is, no host sync), from the slots
the block table names. The step's slot check compares those with the slots the forward pass
used. So blocks changed later (reused, written late, a stale reference) no longer match, nor
does a block list at shipping time that is not the one written. It misses a change that spares
every sampled word, such as one bit flipped on the link. RDMA's and PCIe's own CRCs cover
that, and the full checksums (``integrity``, ``block_digest``) remain as diagnostic modes.

Pure torch, numpy and xxhash; no nixl, vllm or sockets.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
import torch
import xxhash

from kv_connector.common.errors import ConfigurationError
from kv_connector.wire.integrity import manifest_bytes
from kv_connector.wire.protocol import Manifest

TAG = b"kv_connector fingerprints v1"
# bytes
WORD = 8
# words: a 64-byte line, what the memory reads for any one word of it
LINE = 8
# Fibonacci hashing's multiplier (odd)
_MUL = np.uint64(0x9E3779B97F4A7C15)

_tables: dict[tuple[int, int, int], np.ndarray] = {}
_tables_lock = threading.Lock()


def seed_of(request_id: str) -> int:
    """A sample's seed: its request id's XXH3-64 (both ends have it)."""
    return xxhash.xxh3_64_intdigest(request_id.encode())


def _table(block_size: int, layers: int, words: int) -> np.ndarray:
    """``[block_size, layers]`` word positions in ``[0, words)``, fixed (a multiply-shift
    hash of the slot's offset and layer), both ends alike."""
    key = (block_size, layers, words)
    with _tables_lock:
        t = _tables.get(key)
        if t is None:
            with np.errstate(over="ignore"):
                z = np.arange(block_size * layers, dtype=np.uint64) + np.uint64(1)
                t = ((z * _MUL) >> np.uint64(32)) % np.uint64(words)
            t = _tables[key] = t.astype(np.int64).reshape(block_size, layers)
        return t


def coordinates(
    seed: int | np.ndarray,
    positions: np.ndarray,
    layers: int,
    words: int,
    block_size: int,
    last: int | np.ndarray = -1,
) -> np.ndarray:
    """``[n, layers]`` int64: the word sampled of each captured layer at each of ``positions``.

    ``seed`` is the sample's, or each position's sample's ``[n]``. ``last`` is the sample's last
    position (-1 while unknown), whose last layer's word is the row's last. A fixed table by
    offset in the block, turned by a per-block amount, costs a few vector operations a token.
    """
    pos = np.asarray(positions, dtype=np.int64)
    n = pos.shape[0]
    block, offset = np.divmod(pos, block_size)
    with np.errstate(over="ignore"):
        h = (block.astype(np.uint64) + np.asarray(seed, dtype=np.uint64)) * _MUL
        turn = ((h >> np.uint64(32)) % np.uint64(words)).astype(np.int64)
    word = _table(block_size, layers, words)[offset] + turn[:, None]
    word -= words * (word >= words)
    # a block's first valid word
    word[offset == 0, 0] = 0
    ends = (offset == block_size - 1) | (pos == np.broadcast_to(np.asarray(last, dtype=np.int64), (n,)))
    # its last
    word[ends, layers - 1] = words - 1
    out: np.ndarray = word
    return out


def as_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` ``[..., hidden]`` (its last dimension dense) as ``[..., words]`` of int64."""
    if (tensor.shape[-1] * tensor.element_size()) % WORD:
        raise ConfigurationError(
            f"a row of {tensor.shape[-1]} x {tensor.element_size()} bytes is not a whole number of words"
        )
    return tensor.view(torch.int64)


def _offsets(
    words: torch.Tensor,
    lead: tuple[np.ndarray, ...],
    positions: np.ndarray,
    seed: int | np.ndarray,
    block_size: int,
    last: int | np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The sampled words' positions in their rows ``[n, layers]`` and their offsets in
    ``words``'s storage (``gather``)."""
    layers, row = words.shape[-2], words.shape[-1]
    word = coordinates(seed, positions, layers, row, block_size, last)
    strides = words.stride()
    base = np.full(len(positions), words.storage_offset(), dtype=np.int64)
    for idx, stride in zip(lead, strides, strict=False):
        base += np.asarray(idx, dtype=np.int64) * stride
    return word, word + base[:, None] + np.arange(layers, dtype=np.int64)[None, :] * strides[-2]


def _read(words: torch.Tensor, index: np.ndarray, width: int = 1) -> torch.Tensor:
    """The int64 words at storage offsets ``index`` of ``words``, read where they lie.

    With ``width``, the ``width`` words from each offset (``[len(index), width]``): a gather of
    whole rows where every offset is a multiple of ``width``, else of each word.
    """
    storage = words.untyped_storage()
    n = storage.nbytes() // WORD
    aligned = width > 1 and not (index % width).any()
    if width > 1 and not aligned:
        index = (index[:, None] + np.arange(width, dtype=np.int64)).reshape(-1)
    shape = (n // width, width) if aligned else (n,)
    flat = torch.empty(0, dtype=torch.int64, device=words.device).set_(
        storage, 0, shape, (width, 1)[-len(shape) :]
    )
    at = torch.from_numpy(index // width if aligned else index)
    if flat.is_cuda:
        at = at.pin_memory().to(flat.device, non_blocking=True)
    return flat.index_select(0, at).view(-1, width) if width > 1 else flat.index_select(0, at)


def gather(
    words: torch.Tensor,
    lead: tuple[np.ndarray, ...],
    positions: np.ndarray,
    seed: int | np.ndarray,
    block_size: int,
    last: int | np.ndarray = -1,
) -> torch.Tensor:
    """The sampled words ``[n, layers]`` of ``n`` token slots in ``words`` ``[..., layers, words]``.

    Slot ``i`` at ``words[lead[0][i], lead[1][i], ...]`` holds the sample's token ``positions[i]``;
    ``coordinates`` picks the words. Their storage offsets are computed on the host and one 1-D
    gather reads them where they lie. On a GPU the offsets go over from pinned memory on the
    current stream, so nothing waits for the device.
    """
    _, offsets = _offsets(words, lead, positions, seed, block_size, last)
    return _read(words, offsets.reshape(-1)).view(len(positions), words.shape[-2])


def gather_lines(
    words: torch.Tensor,
    positions: np.ndarray,
    seed: int | np.ndarray,
    block_size: int,
    last: int | np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather`` of a sample's ``[T, layers, words]`` with the ``LINE`` words around each sampled one.

    It returns ``(sampled [n, layers], lines [n, layers, LINE])``, each line aligned to ``LINE``
    words in its row. A line costs what its one word does, since memory moves whole cache lines.
    It samples the row's values at a new place from token to token, which is what the values
    screen reads (``reader.pool.values.screen_rows``). Rows must be at least ``LINE`` words.
    """
    row = words.shape[-1]
    if row < LINE:
        raise ConfigurationError(f"a row of {row} words is shorter than a line ({LINE})")
    word, offsets = _offsets(words, (positions,), positions, seed, block_size, last)
    # the word's place in its line
    within = word - np.minimum(word - word % LINE, row - LINE)
    lines = _read(words, (offsets - within).reshape(-1), LINE).view(len(positions), words.shape[-2], LINE)
    pick = torch.from_numpy(within).to(lines.device, non_blocking=True)
    return lines.gather(2, pick.unsqueeze(2)).squeeze(2), lines


def share_spans(manifest: Manifest, share: Iterable[int]) -> list[tuple[int, int]]:
    """The share's valid tokens as ``[start, end)`` ranges, one per run of consecutive blocks."""
    bs, total = manifest.geometry.block_size, manifest.num_tokens
    js = sorted(share)
    if not js:
        return []
    # one run of blocks (every share but a TP stripe's): no numpy
    if js[-1] - js[0] == len(js) - 1:
        start, end = js[0] * bs, min((js[-1] + 1) * bs, total)
        return [(start, end)] if start < end else []
    a = np.asarray(js, dtype=np.int64)
    # blocks past the last token hold none
    a = a[a * bs < total]
    if not len(a):
        return []
    cut = np.flatnonzero(np.diff(a) != 1) + 1
    first, last = a[np.concatenate(([0], cut))], a[np.concatenate((cut - 1, [len(a) - 1]))]
    return list(zip((first * bs).tolist(), np.minimum((last + 1) * bs, total).tolist(), strict=True))


def share_tokens(manifest: Manifest, share: Iterable[int]) -> np.ndarray:
    """The valid token positions of a share's blocks (indices in the sample), in order."""
    spans = share_spans(manifest, share)
    if len(spans) == 1:
        return np.arange(spans[0][0], spans[0][1], dtype=np.int64)
    if not spans:
        return np.zeros(0, dtype=np.int64)
    bounds = np.asarray(spans, dtype=np.int64)
    starts, lengths = bounds[:, 0], bounds[:, 1] - bounds[:, 0]
    # each run's start less what came before
    skip = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return skip + np.arange(lengths.sum(), dtype=np.int64)


def record(manifest: Manifest, share: Iterable[int], words: np.ndarray | torch.Tensor) -> int:
    """A share's fingerprint from the sampled words ``[n, layers]`` of its valid tokens in order."""
    w = words.cpu().numpy() if isinstance(words, torch.Tensor) else words
    h = xxhash.xxh3_64(manifest_bytes(manifest))
    h.update(TAG)
    h.update(np.ascontiguousarray(w, dtype="<i8").tobytes())
    return h.intdigest()


def states_record(states: torch.Tensor, manifest: Manifest, share: Iterable[int]) -> int:
    """The share's fingerprint recomputed from a sample's ``[T, layers, hidden]`` view
    where it lies (the reader's pool, host or GPU): the words its tokens' slots hold now."""
    return record(manifest, share, states_words(states, manifest, share))


def states_words(states: torch.Tensor, manifest: Manifest, share: Iterable[int]) -> torch.Tensor:
    """The sampled words ``[n, layers]`` of the share's valid tokens in ``states``, gathered
    where they lie and not waited for (``record`` reads them)."""
    tokens = share_tokens(manifest, share)
    if not len(tokens):
        return torch.zeros((0, manifest.num_layers), dtype=torch.int64)
    g, seed = manifest.geometry, seed_of(manifest.request_id)
    return gather(as_words(states), (tokens,), tokens, seed, g.block_size, manifest.num_tokens - 1)


def states_record_lines(
    states: torch.Tensor, manifest: Manifest, share: Iterable[int]
) -> tuple[int, torch.Tensor | None]:
    """``states_record`` and the lines around its sampled words, in the states' dtype.

    One read of the share's sampled lines serves both the fingerprint and the values screen;
    the lines are None for rows shorter than a line (``gather_lines``).
    """
    share = sorted(share)
    tokens = share_tokens(manifest, share)
    w = as_words(states)
    if w.shape[-1] < LINE:
        return states_record(states, manifest, share), None
    if not len(tokens):
        empty = torch.zeros((0, manifest.num_layers, LINE), dtype=torch.int64, device=states.device)
        no_words = np.zeros((0, manifest.num_layers), dtype=np.int64)
        return record(manifest, share, no_words), empty.view(states.dtype)
    sampled, lines = gather_lines(
        w, tokens, seed_of(manifest.request_id), manifest.geometry.block_size, manifest.num_tokens - 1
    )
    return record(manifest, share, sampled), lines.view(states.dtype)
