"""Which bytes of a block are the sample's, and the checksum over them, against a
reference built token by token from the block's own tensor shape."""

from __future__ import annotations

import msgspec
import pytest
import torch
import xxhash

from kv_connector.wire import protocol
from kv_connector.wire.integrity import block_checksum, manifest_bytes, sample_checksum, spans_of_sample
from kv_connector.wire.layout import BlockLayout


def valid_spans(
    layout: str, bs: int, layers: int, row_bytes: int, num_tokens: int, j: int
) -> list[tuple[int, int]]:
    """The spans of block ``j`` of a float32 sample (``row_bytes`` = hidden * 4)."""
    return BlockLayout(layout, bs, layers, row_bytes // 4, "float32").valid_spans(num_tokens, j)  # type: ignore[arg-type]


def token_mask(layout: str, bs: int, layers: int, hidden: int, k: int) -> torch.Tensor:
    """Byte mask (float32 elements) of one block: True where tokens 0..k-1 live."""
    shape = (layers, bs, hidden) if layout == "LTH" else (bs, layers, hidden)
    m = torch.zeros(shape, dtype=torch.bool)
    if layout == "LTH":
        m[:, :k, :] = True
    else:
        m[:k] = True
    return m.view(-1).repeat_interleave(4)


@pytest.mark.parametrize("layout", ["LTH", "TLH"])
@pytest.mark.parametrize("num_tokens", [1, 5, 16, 17, 31, 32, 45])
def test_valid_spans_cover_exactly_the_sample_tokens(layout: str, num_tokens: int) -> None:
    bs, layers, hidden = 16, 3, 8
    block_bytes = bs * layers * hidden * 4
    for j in range(-(-num_tokens // bs)):
        k = min(bs, num_tokens - j * bs)
        covered = torch.zeros(block_bytes, dtype=torch.bool)
        for off, n in valid_spans(layout, bs, layers, hidden * 4, num_tokens, j):
            assert not covered[off : off + n].any(), "spans overlap"
            covered[off : off + n] = True
        assert torch.equal(covered, token_mask(layout, bs, layers, hidden, k))


def test_a_block_past_the_sample_is_an_error() -> None:
    with pytest.raises(ValueError, match="none of the sample"):
        valid_spans("LTH", 16, 2, 32, 16, 1)


@pytest.mark.parametrize("layout", ["LTH", "TLH"])
@pytest.mark.parametrize("base", [0, 640, 4096])
def test_cache_and_pool_checksums_agree_with_the_reference(layout: str, base: int) -> None:
    bs, layers, hidden, num_tokens = 16, 3, 8, 45
    g = BlockLayout(layout, bs, layers, hidden, "float32")  # type: ignore[arg-type]
    block_bytes = g.block_bytes
    gen = torch.Generator().manual_seed(0)
    cache = torch.randint(0, 256, (10 * block_bytes,), dtype=torch.uint8, generator=gen)
    block_ids = [7, 2, 5]
    m = protocol.Manifest(
        request_id="r", token_ids=list(range(num_tokens)), layer_ids=[0, 1, 2], geometry=g, num_blocks=3
    )
    spans_of = spans_of_sample(m)

    # reference: the sample's bytes, gathered token by token through the tensor shape
    ref = b""
    for j in range(3):
        blk = cache[block_ids[j] * block_bytes : (block_ids[j] + 1) * block_bytes]
        k = min(bs, num_tokens - j * bs)
        ref += blk[token_mask(layout, bs, layers, hidden, k)].numpy().tobytes()
    # the hash starts with the manifest's own msgpack encoding
    want = xxhash.xxh3_64_intdigest(msgspec.msgpack.encode(m) + ref)

    offsets = [(j, block_ids[j] * block_bytes) for j in range(3)]
    assert block_checksum(cache.numpy().data, offsets, spans_of, manifest_bytes(m)) == want
    assert block_checksum(cache.numpy().data, offsets, spans_of) == xxhash.xxh3_64_intdigest(ref)

    # the same blocks as they land in the reader's pool: a run at ``base``, arranged
    pool = torch.zeros(base + 4 * block_bytes, dtype=torch.uint8)
    for j in range(3):
        for src, dst, n in g.arranged_spans(3, j):
            at = block_ids[j] * block_bytes + src
            pool[base + dst : base + dst + n] = cache[at : at + n]
    assert sample_checksum(pool.numpy().data, base, m, range(3)) == want
    # shares hash separately, and differ
    assert sample_checksum(pool.numpy().data, base, m, [0, 1]) != want

    # one flipped byte inside the sample changes it; one in the last block's tail does not
    (d, _), *_ = g.arranged(3, 2, *spans_of(2)[-1])
    pool[base + d] ^= 1
    assert sample_checksum(pool.numpy().data, base, m, range(3)) != want
    pool[base + d] ^= 1
    tail = next(i for i in range(block_bytes) if not token_mask(layout, bs, layers, hidden, 13)[i])
    ((d, _),) = g.arranged(3, 2, tail, 1)
    pool[base + d] ^= 1
    assert sample_checksum(pool.numpy().data, base, m, range(3)) == want


def _landed_sample() -> tuple[torch.Tensor, protocol.Manifest, torch.Tensor, list[int]]:
    g = BlockLayout("LTH", 16, 2, 8, "float32")
    gen = torch.Generator().manual_seed(1)
    cache = torch.randint(0, 256, (6 * g.block_bytes,), dtype=torch.uint8, generator=gen)
    block_ids = [4, 1]
    m = protocol.Manifest(
        request_id="r-1",
        token_ids=list(range(20)),
        layer_ids=[1, 2],
        geometry=g,
        num_blocks=2,
        sample_id="17",
        metadata=b'{"split":"train"}',
    )
    pool = torch.zeros(2 * g.block_bytes, dtype=torch.uint8)
    for j in range(2):
        for src, dst, n in g.arranged_spans(2, j):
            pool[dst : dst + n] = cache[block_ids[j] * g.block_bytes + src :][:n]
    return cache, m, pool, block_ids


def test_producer_and_reader_digests_agree_and_cover_the_manifest() -> None:
    """The producer's digest (digests.share_checksum, from its cache) equals the reader's
    (from its pool) for the same manifest, and a reader holding a manifest that differs in
    any field (sample id, metadata, token ids, layer ids) computes another."""
    from kv_connector.cache.blocks import share_checksum
    from kv_connector.sender.jobs import Job

    cache, m, pool, block_ids = _landed_sample()
    job = Job("r-1", m, block_ids, range(2), 0.0)
    sent = share_checksum(cache, job)
    assert sent == share_checksum(cache, job, stage=True)  # the device cache's staging path
    assert sample_checksum(pool.numpy().data, 0, m, range(2)) == sent
    for change in (
        {"sample_id": "18"},
        {"sample_id": None},
        {"metadata": b'{"split":"test"}'},
        {"metadata": b""},
        {"token_ids": [1, *range(1, 20)]},
        {"layer_ids": [1, 3]},
    ):
        other = msgspec.structs.replace(m, **change)
        assert sample_checksum(pool.numpy().data, 0, other, range(2)) != sent, change
