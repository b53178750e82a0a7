"""Per-sample checksums: which bytes of a sample's blocks count, and their XXH3-64.

Each rank checksums its share of a sample: the bytes of each block that hold the sample's
tokens, concatenated in block order. The rest of a block is not part of the sample: vLLM goes
on writing decode tokens into the last block's tail while the WRITE runs. Pure logic: xxhash
hashes, with no vllm, nixl or torch.

The hash starts with the manifest's msgpack encoding (``manifest_bytes``), so a share matches
only the manifest its producer hashed it with. Equal Structs encode to the same bytes on both
sides.

The producer hashes its cache (``block_checksum``), the reader its pool (``sample_checksum``).
The hash is streamed, so both get the same number for the same bytes however they are split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
import xxhash

from kv_connector.wire.protocol import Manifest

# Buffers are anything with the buffer protocol (bytes, memoryview, numpy arrays).
Buffer = memoryview
SpanFn = Callable[[int], list[tuple[int, int]]]

_encoder = msgspec.msgpack.Encoder()


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest's msgpack encoding, which every share's checksum starts with."""
    return _encoder.encode(manifest)


def spans_of_sample(manifest: Manifest) -> SpanFn:
    """The bytes of each block (by index) that hold the sample's tokens
    (``BlockLayout.valid_spans``)."""
    return manifest.valid_spans


def block_checksum(
    buf: Buffer, block_offsets: Iterable[tuple[int, int]], spans_of: SpanFn, prefix: bytes = b""
) -> int:
    """XXH3-64 of ``prefix`` and a share whose blocks are contiguous in ``buf``.

    ``prefix`` is the manifest's bytes; ``block_offsets`` yields each block's index in the sample
    and its byte offset in ``buf``, in order.
    """
    # byte offsets, whatever the buffer's shape
    buf = memoryview(buf).cast("B")
    h = xxhash.xxh3_64(prefix)
    for j, base in block_offsets:
        for off, n in spans_of(j):
            h.update(buf[base + off : base + off + n])
    return h.intdigest()


def sample_checksum(pool: Buffer, base: int, manifest: Manifest, share: Iterable[int]) -> int:
    """XXH3-64 of the manifest's bytes and a share as it landed in the reader's pool at ``base``.

    It reads the spans ``BlockLayout.arranged_spans`` gives, so it hashes the same bytes in the
    same order as the producer hashed them from its cache.
    """
    pool = memoryview(pool).cast("B")
    g, nb = manifest.geometry, manifest.num_blocks
    h = xxhash.xxh3_64(manifest_bytes(manifest))
    for j in share:
        for off, n in manifest.valid_spans(j):
            for dst, k in g.arranged(nb, j, off, n):
                h.update(pool[base + dst : base + dst + k])
    return h.intdigest()
