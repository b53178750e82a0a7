"""Block digests: a share's checksum computed where the cache is, recomputed by the reader on CPU.

Computed with torch on a GPU cache, only 8 bytes per block reach the host. A block's digest
is a weighted sum of its 64-bit words, modulo 2**64:

    digest(block) = sum over its valid tokens t, layers l, words k of
                    W[t, l, k] * x[t, l, k]

``x[t, l, k]`` is the k-th 8-byte word of token t's row at layer l, read as a signed int64;
a row must be a multiple of 8 bytes (``supported``). ``W`` is a fixed table of odd 64-bit
weights, splitmix64 of the word's position in the block. Only the sample's tokens count, not
the tail of its last block that vLLM keeps writing during decode.

The coordinates are the sample's (token, layer, word), not byte offsets. So the producer's
cache blocks (LTH or TLH) and the reader's pool run give the same number. Integer sums are
exact and order-free, so a GPU's reduction and the reader's dot products agree bit for bit.

A share's checksum is XXH3-64 over the manifest's bytes, a tag, and each block's index and
digest in block order. It binds the manifest as the byte checksum does. It detects corruption,
not forgery (the secret does that). Changing one word changes its block's digest (the weights
are odd), and unrelated changes collide with probability about 2**-64.

Pure torch, numpy and xxhash; no nixl, vllm or sockets.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable

import numpy as np
import torch
import xxhash

from kv_connector.common.errors import ConfigurationError
from kv_connector.wire.integrity import manifest_bytes
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.protocol import Manifest

TAG = b"kv_connector block digests v1"
# cache bytes per gather on the cache's device (the temporaries stay small)
CHUNK_BYTES = 32 << 20

# bytes
WORD = 8


_weights: dict[tuple[tuple[int, int, int], torch.device], torch.Tensor] = {}
_weights_lock = threading.Lock()


def supported(layout: BlockLayout) -> bool:
    """Whether a token's row of one layer is a whole number of 8-byte words (what block
    digests and fingerprints alike read)."""
    return layout.row_bytes % WORD == 0


def weights(block_size: int, num_layers: int, words: int, device: torch.device) -> torch.Tensor:
    """W: ``[block_size, num_layers, words]`` odd int64 weights (splitmix64 of the position)."""
    shape = (block_size, num_layers, words)
    key = (shape, torch.device(device))
    with _weights_lock:
        w = _weights.get(key)
        if w is None:
            with np.errstate(over="ignore"):
                z = np.arange(block_size * num_layers * words, dtype=np.uint64)
                z = z + np.uint64(0x9E3779B97F4A7C15)
                z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
                z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
                z = (z ^ (z >> np.uint64(31))) | np.uint64(1)
            w = torch.from_numpy(z.view(np.int64).reshape(shape)).to(device)
            _weights[key] = w
        return w


def as_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` ``[..., hidden]`` (its last dimension dense) as ``[..., words]`` of int64."""
    if (tensor.shape[-1] * tensor.element_size()) % WORD:
        raise ConfigurationError(
            f"a row of {tensor.shape[-1]} x {tensor.element_size()} bytes is not a whole number of words"
        )
    return tensor.view(torch.int64)


def digests_of_blocks(blocks: torch.Tensor, valid: int | None = None) -> torch.Tensor:
    """The ``[c]`` int64 digests of ``c`` blocks ``[c, block_size, layers, hidden]``, on any device.

    Any strides work if the last dimension is dense; with ``valid``, only the first ``valid``
    tokens of each block count. This is the producer's path, on its cache's device.
    """
    x = as_words(blocks)
    _, bs, nl, nw = x.shape
    w = weights(bs, nl, nw, x.device)
    if valid is not None and valid < bs:
        x, w = x[:, :valid], w[:valid]
    return (x * w).sum(dim=(1, 2, 3))


def _wrap(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def _block_view(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """A cache ``[num_blocks, *block_shape]`` as ``[num_blocks, block_size, layers, hidden]``."""
    return cache if layout == "TLH" else cache.permute(0, 2, 1, 3)


def cache_block_digests(
    cache: torch.Tensor, manifest: Manifest, block_ids: list[int], share: Iterable[int]
) -> list[int]:
    """The digests of a share's blocks, read from the cache ``[num_blocks, *block_shape]`` where it is.

    Block ``j`` of the sample is cache block ``block_ids[j]``. It reads in chunks of at most
    ``CHUNK_BYTES`` so the temporaries on the device stay small. Where the cache is on a GPU the
    caller runs this on a stream of its own.
    """
    g = manifest.geometry
    view = _block_view(cache, g.layout)
    chunk = max(1, CHUNK_BYTES // g.block_bytes)
    share = sorted(share)
    last = manifest.num_blocks - 1
    # tokens of the sample in its last block
    tail = manifest.num_tokens - last * g.block_size
    full = [j for j in share if j != last]
    out: dict[int, int] = {}
    for i in range(0, len(full), chunk):
        js = full[i : i + chunk]
        idx = torch.tensor([block_ids[j] for j in js], device=cache.device)
        d = digests_of_blocks(view.index_select(0, idx)).cpu().tolist()
        out.update(zip(js, d, strict=True))
    if last in share:
        blk = view[block_ids[last] : block_ids[last] + 1]
        out[last] = int(digests_of_blocks(blk, tail).cpu()[0])
    return [out[j] for j in share]


def sample_block_digests(states: torch.Tensor, manifest: Manifest, share: Iterable[int]) -> list[int]:
    """The same digests from a sample's ``[T, layers, hidden]`` CPU view, as integer dot products.

    This is the reader's path for a host pool of either layout; dot products over the dense rows
    run several times faster than a torch multiply-and-sum.
    """
    bs = manifest.geometry.block_size
    x = as_words(states)
    _, nl, nw = x.shape
    w = weights(bs, nl, nw, torch.device("cpu")).numpy()
    # [layers, block_size, words]: each layer's weights dense, for LTH
    by_layer = None
    out = []
    with np.errstate(over="ignore"):
        for j in sorted(share):
            # [v, layers, words]
            rows = x[j * bs : (j + 1) * bs].numpy()
            v = rows.shape[0]
            # TLH: the block's rows one after the other
            if rows.flags.c_contiguous:
                total = int(rows.reshape(-1) @ w[:v].reshape(-1))
            # LTH: each layer's rows are dense
            else:
                if by_layer is None:
                    by_layer = np.ascontiguousarray(w.transpose(1, 0, 2))
                total = sum(int(rows[:, k].reshape(-1) @ by_layer[k, :v].reshape(-1)) for k in range(nl))
            out.append(_wrap(total))
    return out


def states_block_digests(states: torch.Tensor, manifest: Manifest, share: Iterable[int]) -> list[int]:
    """The same digests from a sample's ``[T, layers, hidden]`` view where it lies, with torch ops.

    This is the reader's path for a pool on a GPU: the producer's arithmetic
    (``digests_of_blocks``) over the sample's blocks, in chunks of at most ``CHUNK_BYTES``.
    """
    g = manifest.geometry
    bs, last = g.block_size, manifest.num_blocks - 1
    share = sorted(share)
    full = [j for j in share if j != last]
    out: dict[int, int] = {}
    if full:
        head = states[: last * bs]
        # [blocks, block_size, L, H]: splits one dim
        blocks = head.view(last, bs, *head.shape[1:])
        chunk = max(1, CHUNK_BYTES // g.block_bytes)
        for i in range(0, len(full), chunk):
            js = full[i : i + chunk]
            idx = torch.tensor(js, device=states.device)
            d = digests_of_blocks(blocks.index_select(0, idx)).cpu().tolist()
            out.update(zip(js, d, strict=True))
    if last in share:
        # [1, valid tokens, L, H]
        tail = states[last * bs : manifest.num_tokens].unsqueeze(0)
        x = as_words(tail)
        w = weights(bs, x.shape[2], x.shape[3], x.device)[: x.shape[1]]
        out[last] = int((x * w).sum().cpu())
    return [out[j] for j in share]


def checksum_of_digests(manifest: Manifest, share: Iterable[int], digests: list[int]) -> int:
    """XXH3-64 of the manifest's bytes, the tag, and each (block index, digest) in order."""
    h = xxhash.xxh3_64(manifest_bytes(manifest))
    h.update(TAG)
    h.update(b"".join(struct.pack("<Iq", j, d) for j, d in zip(sorted(share), digests, strict=True)))
    return h.intdigest()
