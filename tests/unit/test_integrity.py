"""Which bytes of a block are the sample's, and the checksum over them, against a
reference built token by token from the block's own tensor shape."""

from __future__ import annotations

import functools
import random

import pytest
import torch
import xxhash

from kv_connector.integrity import block_checksum, paged_checksum
from kv_connector.layout import BlockLayout


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
@pytest.mark.parametrize("page_bytes", [None, 640, 1000, 4096])
def test_paged_and_cache_checksums_agree_with_the_reference(layout: str, page_bytes: int | None) -> None:
    bs, layers, hidden, num_tokens = 16, 3, 8, 45
    block_bytes = bs * layers * hidden * 4
    page_bytes = page_bytes or block_bytes
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    cache = torch.randint(0, 256, (10 * block_bytes,), dtype=torch.uint8, generator=g)
    block_ids = [7, 2, 5]
    share = [0, 1, 2]
    spans_of = functools.partial(valid_spans, layout, bs, layers, hidden * 4, num_tokens)

    # reference: the sample's bytes, gathered token by token through the tensor shape
    ref = b""
    for j in share:
        blk = cache[block_ids[j] * block_bytes : (block_ids[j] + 1) * block_bytes]
        k = min(bs, num_tokens - j * bs)
        ref += blk[token_mask(layout, bs, layers, hidden, k)].numpy().tobytes()
    want = xxhash.xxh3_64_intdigest(ref)

    mv = cache.numpy().data
    got = block_checksum(mv, ((j, block_ids[j] * block_bytes) for j in share), spans_of)
    assert got == want

    # the same blocks scattered over pool pages, a block over several pages
    ppb = -(-block_bytes // page_bytes)
    pages = rng.sample(range(64), len(share) * ppb)
    pool = torch.zeros(64 * page_bytes, dtype=torch.uint8)
    for j in share:
        blk = cache[block_ids[j] * block_bytes : (block_ids[j] + 1) * block_bytes]
        for p in range(ppb):
            piece = blk[p * page_bytes : (p + 1) * page_bytes]
            base = pages[j * ppb + p] * page_bytes
            pool[base : base + len(piece)] = piece
    assert paged_checksum(pool.numpy().data, pages, ppb, page_bytes, share, spans_of) == want

    # one flipped byte inside the sample changes it; one in the last block's tail does not
    j, (off, _) = 2, spans_of(2)[-1]
    base = pages[j * ppb + off // page_bytes] * page_bytes + off % page_bytes
    pool[base] ^= 1
    assert paged_checksum(pool.numpy().data, pages, ppb, page_bytes, share, spans_of) != want
    pool[base] ^= 1
    tail = next(i for i in range(block_bytes) if not token_mask(layout, bs, layers, hidden, 13)[i])
    base = pages[j * ppb + tail // page_bytes] * page_bytes + tail % page_bytes
    pool[base] ^= 1
    assert paged_checksum(pool.numpy().data, pages, ppb, page_bytes, share, spans_of) == want
