"""Block digests (``kv_connector.wire.block_digest``): the producer's number from its cache
blocks and the reader's from the arranged run in its pool agree bit for bit, for both
layouts and element widths; they equal an independent reference computed element by
element in Python integers; they cover exactly the sample's tokens and its manifest."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from kv_connector.cache.blocks import share_block_digest
from kv_connector.reader.pool.lease import sample_view
from kv_connector.sender.jobs import Job
from kv_connector.wire import protocol
from kv_connector.wire.block_digest import (
    TAG,
    cache_block_digests,
    checksum_of_digests,
    sample_block_digests,
    states_block_digests,
    weights,
)
from kv_connector.wire.integrity import manifest_bytes
from kv_connector.wire.layout import BlockLayout

MASK = (1 << 64) - 1


def landed(
    layout: str, dtype: str, num_tokens: int, bs: int = 4, layers: int = 3, hidden: int = 8, seed: int = 0
) -> tuple[torch.Tensor, protocol.Manifest, list[int], torch.Tensor]:
    """A cache of random bits (NaNs included), a sample on scattered blocks, and the run
    of pool bytes the reader holds once every block's WRITE landed (arranged)."""
    g = BlockLayout(layout, bs, layers, hidden, dtype)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    num_cache = 9
    raw = torch.randint(0, 256, (num_cache * g.block_bytes,), dtype=torch.uint8, generator=gen)
    nb = g.blocks_for(num_tokens)
    block_ids = torch.randperm(num_cache, generator=gen)[:nb].tolist()
    m = protocol.Manifest(
        request_id="r", token_ids=list(range(num_tokens)), layer_ids=list(range(layers)), geometry=g,
        num_blocks=nb,
    )  # fmt: skip
    run = torch.zeros(g.sample_bytes(nb), dtype=torch.uint8)
    for j in range(nb):
        for src, dst, n in g.arranged_spans(nb, j):
            at = block_ids[j] * g.block_bytes + src
            run[dst : dst + n] = raw[at : at + n]
    return raw, m, block_ids, run


def typed_cache(raw: torch.Tensor, m: protocol.Manifest) -> torch.Tensor:
    g = m.geometry
    return raw.view(getattr(torch, g.dtype)).view(-1, *g.block_shape())


def reference(raw: torch.Tensor, m: protocol.Manifest, block_ids: list[int], j: int) -> int:
    """Block ``j``'s digest word by word: each 8 bytes of a (token, layer) row as a signed
    integer times the weight of (token, layer, word), summed in Python integers, mod 2**64."""
    g = m.geometry
    row = g.block_bytes // (g.block_size * g.num_layers)
    nw = row // 8
    w = weights(g.block_size, g.num_layers, nw, torch.device("cpu"))
    blk = raw[block_ids[j] * g.block_bytes : (block_ids[j] + 1) * g.block_bytes].numpy().tobytes()
    total = 0
    for t in range(min(g.block_size, m.num_tokens - j * g.block_size)):
        for layer in range(g.num_layers):
            at = (layer * g.block_size + t) * row if g.layout == "LTH" else (t * g.num_layers + layer) * row
            for k in range(nw):
                (x,) = struct.unpack_from("<q", blk, at + 8 * k)
                total += x * int(w[t, layer, k])
    total &= MASK
    return total - (1 << 64) if total >> 63 else total


@pytest.mark.parametrize("layout", ["LTH", "TLH"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("num_tokens", [1, 4, 7, 12])
def test_cache_and_pool_agree_with_the_reference(layout: str, dtype: str, num_tokens: int) -> None:
    raw, m, block_ids, run = landed(layout, dtype, num_tokens)
    share = list(range(m.num_blocks))
    want = [reference(raw, m, block_ids, j) for j in share]
    assert cache_block_digests(typed_cache(raw, m), m, block_ids, share) == want
    assert sample_block_digests(sample_view(run, m), m, share) == want
    assert states_block_digests(sample_view(run, m), m, share) == want  # a reader's pool on a device
    odd = share[1::2]  # a rank's share: its own blocks, last one partly filled or not
    assert states_block_digests(sample_view(run, m), m, odd) == [want[j] for j in odd]
    # the share's checksum: the manifest's bytes, the tag, (index, digest) per block
    body = b"".join(struct.pack("<Iq", j, d) for j, d in zip(share, want, strict=True))
    assert checksum_of_digests(m, share, want) == xxhash.xxh3_64_intdigest(manifest_bytes(m) + TAG + body)


@pytest.mark.parametrize("layout", ["LTH", "TLH"])
def test_gathers_in_chunks_give_the_same_digests(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    raw, m, block_ids, _ = landed(layout, "bfloat16", 30, bs=4)
    share = list(range(m.num_blocks))
    whole = cache_block_digests(typed_cache(raw, m), m, block_ids, share)
    monkeypatch.setattr("kv_connector.wire.block_digest.CHUNK_BYTES", 1)  # one block per gather
    assert cache_block_digests(typed_cache(raw, m), m, block_ids, share) == whole
    assert states_block_digests(sample_view(landed(layout, "bfloat16", 30, bs=4)[3], m), m, share) == whole
    # a rank's share is its own blocks, in block order, whatever order it names them in
    odd = [5, 1, 3]
    assert cache_block_digests(typed_cache(raw, m), m, block_ids, odd) == [whole[j] for j in sorted(odd)]


@pytest.mark.parametrize("layout", ["LTH", "TLH"])
def test_one_changed_element_in_the_sample_changes_it_and_the_tail_does_not(layout: str) -> None:
    raw, m, block_ids, run = landed(layout, "bfloat16", 10, bs=4)  # 3 blocks, 2 tokens in the last
    share = list(range(m.num_blocks))
    want = checksum_of_digests(m, share, sample_block_digests(sample_view(run, m), m, share))
    states = sample_view(run, m)
    for t, layer, h in [(0, 0, 0), (5, 2, 4), (9, 1, 3)]:
        bits = states[t, layer, h].view(torch.int16)
        for flip in (1, 1 << 15):  # the lowest bit, and the sign (an element's bits, not its value)
            bits ^= flip
            got = checksum_of_digests(m, share, sample_block_digests(sample_view(run, m), m, share))
            assert got != want, (t, layer, h, flip)
            bits ^= flip
    # the last block's tail (tokens 10, 11) is not the sample's: vLLM keeps writing there
    cache = typed_cache(raw, m)
    last = cache[block_ids[2]]
    tail = last[:, 3] if layout == "LTH" else last[3]
    tail.view(torch.int16).bitwise_xor_(0x5555)
    assert checksum_of_digests(m, share, cache_block_digests(cache, m, block_ids, share)) == want


def test_the_manifest_is_covered() -> None:
    raw, m, block_ids, _ = landed("TLH", "float32", 7)
    share = list(range(m.num_blocks))
    d = cache_block_digests(typed_cache(raw, m), m, block_ids, share)
    other = protocol.Manifest(
        request_id="r", token_ids=[0, 1, 2, 3, 4, 5, 99], layer_ids=m.layer_ids, geometry=m.geometry,
        num_blocks=m.num_blocks,
    )  # fmt: skip
    assert checksum_of_digests(m, share, d) != checksum_of_digests(other, share, d)


def test_the_senders_path_over_its_flat_cache_bytes() -> None:
    """What a rank computes on its hashing thread (``digests.share_block_digest``, from
    the cache as one flat uint8 tensor) is the reader's number for the same share."""
    raw, m, block_ids, run = landed("LTH", "bfloat16", 11, bs=4)
    job = Job("r", m, block_ids, share=range(1, 3), t_submit=0.0)  # blocks 1 and 2 of 3
    want = checksum_of_digests(m, [1, 2], sample_block_digests(sample_view(run, m), m, [1, 2]))
    assert share_block_digest(raw, job) == want


def test_rows_that_are_not_whole_words_are_refused() -> None:
    from kv_connector.wire.block_digest import as_words, supported

    assert as_words(torch.zeros(2, 4, dtype=torch.bfloat16)).shape == (2, 1)
    assert supported(BlockLayout("TLH", 16, 2, 4096, "bfloat16"))
    assert not supported(BlockLayout("TLH", 16, 2, 6, "bfloat16"))
    with pytest.raises(ValueError, match="whole number of words"):
        as_words(torch.zeros(2, 6, dtype=torch.bfloat16))
