"""How the producer reads a sample from its cache, in both delivery modes.

The cache-only layer's tensor is blocks, dense inside and ``pitch`` bytes apart; the pitch is
one block, or a page vLLM padded to its other groups' page size. Its bytes are one flat view
from the first block's start to the last one's end, which NIXL registers. Push's WRITEs and
pull's READs both address block ``i`` at ``i * pitch``, so the padding is never shipped.
``share_of`` gives a rank's share of a sample, and ``CacheBlocks.record`` its integrity record
read where the blocks are. The sender and the pull server read blocks only through here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kv_connector.cache.hasher import own_stream
from kv_connector.common.errors import ConfigurationError, IntegrityError
from kv_connector.wire import fingerprint, protocol
from kv_connector.wire.block_digest import cache_block_digests, checksum_of_digests
from kv_connector.wire.identity import SampleIdentity
from kv_connector.wire.integrity import block_checksum, manifest_bytes, spans_of_sample
from kv_connector.wire.layout import BlockLayout, stripe
from kv_connector.wire.protocol import Manifest, ShareChecksum
from kv_connector.wire.provenance import Provenance


class ShareOf(Protocol):
    """A rank's share of a sample: ``block_ids`` the cache blocks of all the sample's
    blocks in order, ``share`` the range of them this rank serves."""

    @property
    def manifest(self) -> Manifest: ...

    @property
    def block_ids(self) -> list[int]: ...

    @property
    def share(self) -> range: ...


class Fingerprinted(Protocol):
    """A sample's fingerprint words as the producer's steps took them
    (``producer.fingerprints.SampleWords``)."""

    def record(self, manifest: Manifest, share: Iterable[int]) -> int: ...


@dataclass(frozen=True)
class Share:
    """``share_of``'s answer (a ``ShareOf``)."""

    manifest: Manifest
    block_ids: list[int]
    share: range


def pitch_of(cache: torch.Tensor, layout: BlockLayout) -> int:
    """Bytes from one cache block's start to the next: the tensor's first stride (one
    block when dense, more where vLLM padded the page), one block for a one-block cache."""
    return cache.stride(0) * cache.element_size() if cache.shape[0] > 1 else layout.block_bytes


def flat_bytes(cache: torch.Tensor, block_bytes: int, pitch: int) -> torch.Tensor:
    """The cache's bytes as one flat uint8 tensor, block i at ``i * pitch``.

    ValueError where the tensor is not dense blocks of ``block_bytes`` that far apart.
    """
    nb = cache.shape[0]
    stride = cache.stride(0) * cache.element_size() if nb > 1 else pitch
    nbytes = (nb - 1) * pitch + block_bytes
    start = cache.storage_offset() * cache.element_size()
    held = cache.numel() * cache.element_size()
    if held != nb * block_bytes or stride != pitch or pitch < block_bytes:
        raise ConfigurationError(
            f"cache tensor of {nb} blocks, {stride} bytes apart, holds {held} bytes; the "
            f"layout says dense blocks of {block_bytes}, {pitch} bytes apart"
        )
    if start + nbytes > cache.untyped_storage().nbytes():
        raise ConfigurationError(f"cache tensor's {nb} blocks of pitch {pitch} run past its storage")
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(
        cache.untyped_storage(), start, (nbytes,), (1,)
    )


def blocks_view(raw: torch.Tensor, block_bytes: int, pitch: int) -> torch.Tensor:
    """The cache's flat bytes ``raw`` (block i at ``i * pitch``) as ``[num_blocks,
    block_bytes]``, the padding between blocks left out."""
    return raw.as_strided(((raw.numel() - block_bytes) // pitch + 1, block_bytes), (pitch, 1))


def share_checksum(
    raw: torch.Tensor, job: ShareOf, stage: bool | None = None, pitch: int | None = None
) -> int:
    """XXH3-64 of ``job``'s manifest and share (``integrity``), read from the cache's flat bytes ``raw``.

    A host cache is hashed in place; a device cache's share is staged to host memory once.
    ``stage`` forces either path.
    """
    m = job.manifest
    pitch = pitch or m.block_bytes
    spans_of, head = spans_of_sample(m), manifest_bytes(m)
    if not (raw.device.type != "cpu" if stage is None else stage):
        offsets = ((j, job.block_ids[j] * pitch) for j in job.share)
        return block_checksum(raw.numpy().data, offsets, spans_of, head)
    idx = torch.tensor([job.block_ids[j] for j in job.share], device=raw.device)
    host = blocks_view(raw, m.block_bytes, pitch).index_select(0, idx).cpu().view(-1)
    staged = ((j, i * m.block_bytes) for i, j in enumerate(job.share))
    return block_checksum(host.numpy().data, staged, spans_of, head)


def share_block_digest(raw: torch.Tensor, job: ShareOf, pitch: int | None = None) -> int:
    """The checksum of ``job``'s share over its block digests (``block_digest``), computed where ``raw`` is.

    On a GPU it runs on the calling thread's own stream, and 8 bytes per block reach the host.
    """
    m = job.manifest
    g = m.geometry
    blocks = blocks_view(raw, m.block_bytes, pitch or m.block_bytes)
    cache = blocks.view(getattr(torch, g.dtype)).view(-1, *g.block_shape())
    with own_stream(raw.device):
        digests = cache_block_digests(cache, m, job.block_ids, job.share)
    return checksum_of_digests(m, job.share, digests)


class CacheBlocks:
    """The cache-only layer's tensor ``cache`` as a delivery mode reads it: flat bytes, pitch, blocks.

    ``raw`` is what is registered. ``stage`` says how XXH3 reads a share: None stages a device
    cache's shares to host memory and not a host one's. True or False forces either path, so
    tests can take the GPU path on CPU.
    """

    def __init__(
        self, cache: torch.Tensor, layout: BlockLayout, provenance: Provenance | None = None
    ) -> None:
        self.layout = layout
        # named in every manifest
        self.provenance = provenance
        self.num_blocks = cache.shape[0]
        self.pitch = pitch_of(cache, layout)
        self.raw = flat_bytes(cache, layout.block_bytes, self.pitch)
        self.stage: bool | None = None

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def padded(self) -> bool:
        return self.pitch != self.layout.block_bytes

    def rebind(self, cache: torch.Tensor) -> None:
        """The cache after vLLM's wake (its memory may have moved): the same blocks."""
        if cache.shape[0] != self.num_blocks:
            raise ConfigurationError(
                f"the cache has {cache.shape[0]} blocks after the wake, {self.num_blocks} before"
            )
        self.raw = flat_bytes(cache, self.layout.block_bytes, self.pitch)

    def release(self) -> None:
        """The cache's memory goes back to vLLM (sleep): keep no view of it."""
        self.raw = torch.empty(0, dtype=torch.uint8, device=self.raw.device)

    def share_of(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        layer_ids: list[int],
        identity: SampleIdentity,
        rank: int,
        world_size: int,
    ) -> Share:
        """A computed sample's manifest, its blocks in block-table order, and the stripe ``rank`` serves.

        ValueError where it cannot travel (its id, too few blocks, a block outside the cache); nothing
        is read then.
        """
        problem = protocol.request_id_problem(request_id)
        if problem is not None:
            raise ConfigurationError(problem)
        n = self.layout.blocks_for(len(token_ids))
        if len(block_ids) < n:
            raise ConfigurationError(
                f"{request_id}: {len(token_ids)} tokens need {n} blocks, got {len(block_ids)}"
            )
        blocks = [int(b) for b in block_ids[:n]]
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise ConfigurationError(f"{request_id}: block id {b} outside the cache's {self.num_blocks}")
        manifest = Manifest(
            request_id=request_id,
            token_ids=[int(t) for t in token_ids],
            layer_ids=layer_ids,
            geometry=self.layout,
            num_blocks=n,
            sample_id=identity.sample_id,
            metadata=identity.metadata_json,
            provenance=self.provenance,
        )
        return Share(manifest, blocks, stripe(n, rank, world_size))

    def token_words(
        self,
        block_ids: np.ndarray,
        offsets: np.ndarray,
        positions: np.ndarray,
        seeds: np.ndarray,
        last: int | np.ndarray = -1,
    ) -> torch.Tensor:
        """The fingerprint words ``[n, layers]`` of ``n`` token slots, gathered where the cache is.

        Each slot is (cache block, offset) and holds its sample's token at ``positions``; ``seeds``
        names the sample and ``last`` its last position (-1 while unknown). Nothing waits.
        """
        g = self.layout
        blocks = blocks_view(self.raw, g.block_bytes, self.pitch).view(getattr(torch, g.dtype))
        cache = blocks.view(-1, *g.block_shape())
        # [nb, block, layers, hidden]
        view = cache if g.layout == "TLH" else cache.permute(0, 2, 1, 3)
        words = fingerprint.as_words(view)
        return fingerprint.gather(words, (block_ids, offsets), positions, seeds, g.block_size, last)

    def record(self, kind: ShareChecksum, share: ShareOf, words: Fingerprinted | None = None) -> int:
        """The share's integrity record: its fingerprint from ``words``, or read from its blocks.

        A fingerprint reads nothing from the cache now. Block digests are computed on the cache's
        device, 8 bytes per block to the host; XXH3 reads the bytes. ValueError for a fingerprint
        without words.
        """
        if kind is ShareChecksum.FINGERPRINT:
            if words is None:
                raise IntegrityError(f"{share.manifest.request_id}: no fingerprint words were taken of it")
            return words.record(share.manifest, share.share)
        if kind is ShareChecksum.BLOCKS:
            return share_block_digest(self.raw, share, self.pitch)
        return share_checksum(self.raw, share, self.stage, self.pitch)
