"""Block, slot and page arithmetic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kv_connector.wire.layout import (
    AmbiguousCacheView,
    BlockLayout,
    blocks_for_tokens,
    kernel_block_ids,
    layout_from_view,
    merge_runs,
    pages_for,
    stripe,
)


@given(st.integers(0, 5000), st.integers(1, 16))
def test_stripes_cover_every_block_once_and_balance(n: int, world: int) -> None:
    shares = [stripe(n, r, world) for r in range(world)]
    flat = [b for s in shares for b in s]
    assert flat == list(range(n))
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1


def test_stripe_rejects_bad_rank() -> None:
    with pytest.raises(ValueError):
        stripe(4, 4, 4)


@given(st.integers(1, 1 << 30), st.integers(64, 1 << 20))
def test_pages_for_covers_the_bytes(nbytes: int, page: int) -> None:
    n = pages_for(nbytes, page)
    assert (n - 1) * page < nbytes <= n * page


@pytest.mark.parametrize("layout", ["LTH", "TLH"])
@pytest.mark.parametrize("nb", [1, 2, 5])
def test_arranged_spans_put_every_block_where_the_sample_view_reads_it(layout: str, nb: int) -> None:
    """Blocks of a cache, arranged into a run as the reader's pool holds them, read back
    through the run's [T, L, H] view token by token (an independent reference: the
    cache's own tensor indexing)."""
    g = BlockLayout(layout, 4, 3, 2, "float32")  # type: ignore[arg-type]
    cache = torch.arange(7 * g.block_bytes // 4, dtype=torch.float32).view(7, *g.block_shape())
    block_ids = [5, 0, 6, 2, 3][:nb]
    raw_cache = cache.view(-1).view(torch.uint8)
    run = torch.zeros(g.sample_bytes(nb), dtype=torch.uint8)
    seen = torch.zeros_like(run, dtype=torch.bool)
    for j in range(nb):
        for src, dst, n in g.arranged_spans(nb, j):
            assert not seen[dst : dst + n].any()
            seen[dst : dst + n] = True
            base = block_ids[j] * g.block_bytes + src
            run[dst : dst + n] = raw_cache[base : base + n]
    assert bool(seen.all())  # the run is tiled exactly
    typed = run.view(torch.float32)
    rows = nb * g.block_size
    view = typed.view(rows, 3, 2) if layout == "TLH" else typed.view(3, rows, 2).permute(1, 0, 2)
    for t in range(rows):
        b, off = block_ids[t // 4], t % 4
        want = cache[b, :, off] if layout == "LTH" else cache[b, off]
        assert torch.equal(view[t], want), t
    # a span of block bytes maps to the same bytes of the run
    for j in range(nb):
        for off, n in g.valid_spans(rows - 1, j):
            pieces = g.arranged(nb, j, off, n)
            assert sum(k for _, k in pieces) == n
            got = torch.cat([run[d : d + k] for d, k in pieces])
            base = block_ids[j] * g.block_bytes + off
            assert torch.equal(got, raw_cache[base : base + n])


def test_block_layout_bytes_and_shape() -> None:
    lay = BlockLayout("TLH", 16, 4, 4096, "bfloat16")
    assert lay.token_bytes == 32 * 1024
    assert lay.block_bytes == 16 * 32 * 1024
    assert lay.block_shape() == (16, 4, 4096)
    assert BlockLayout("LTH", 16, 4, 8, "float32").block_shape() == (4, 16, 8)
    with pytest.raises(ValueError):
        BlockLayout("LTH", 16, 4, 8, "int3")


def test_layout_is_read_from_the_view_strides() -> None:
    L, bs, H = 3, 128, 64
    # CPU: the layer's view [nb, L, bs, H] is contiguous.
    assert layout_from_view((10, L, bs, H), (L * bs * H, bs * H, H, 1), L, H) == ("LTH", bs, L * bs * H, 1)
    # GPU: the same view over [nb, bs, L, H] memory.
    assert layout_from_view((10, L, 16, H), (16 * L * H, H, L * H, 1), L, H) == ("TLH", 16, 16 * L * H, 1)
    # num_layers == block_size: the view convention decides, strides tell the memory order.
    assert layout_from_view((10, 4, 4, H), (16 * H, 4 * H, H, 1), 4, H) == ("LTH", 4, 16 * H, 1)
    assert layout_from_view((10, 4, 4, H), (16 * H, H, 4 * H, 1), 4, H) == ("TLH", 4, 16 * H, 1)
    # a plain [nb, bs, L, H] tensor is not the view vLLM's cache-only layer writes through
    with pytest.raises(AmbiguousCacheView, match="dimension 1 holds 16"):
        layout_from_view((10, 16, L, H), (16 * L * H, L * H, H, 1), L, H)
    with pytest.raises(AmbiguousCacheView, match="captured layers"):
        layout_from_view((10, 5, 6, H), (30 * H, 6 * H, H, 1), L, H)
    with pytest.raises(AmbiguousCacheView, match="hidden_size"):
        layout_from_view((10, L, 16, 32), (L * 16 * 32, 16 * 32, 32, 1), L, H)
    with pytest.raises(AmbiguousCacheView, match="overlap"):
        layout_from_view((10, L, bs, H), (L * bs * H // 2, bs * H, H, 1), L, H)
    # planes with other blocks between them (LHBNC)
    with pytest.raises(AmbiguousCacheView, match="blocks between them"):
        layout_from_view((10, L, 16, H), (16 * H, 10 * 16 * H, H, 1), L, H)


def test_kernel_blocks_come_from_the_manager_block() -> None:
    """A view split into kernel blocks (vLLM: ``block_size > kernel_block_size``): the
    manager's block size and count say how many tensor blocks make one of its blocks."""
    L, H, nb = 3, 64, 10
    shape, strides = (4 * nb, L, 16, H), (16 * L * H, H, L * H, 1)
    assert layout_from_view(shape, strides, L, H, 64, nb) == ("TLH", 16, 16 * L * H, 4)
    assert layout_from_view(shape, strides, L, H) == ("TLH", 16, 16 * L * H, 1)  # taken as it is
    with pytest.raises(AmbiguousCacheView, match="20 were expected"):
        layout_from_view(shape, strides, L, H, 32, nb)
    assert kernel_block_ids([5, 2], 4) == [20, 21, 22, 23, 8, 9, 10, 11]
    assert kernel_block_ids([5, 2], 1) == [5, 2]


def test_padded_blocks_are_read_with_their_pitch() -> None:
    """vLLM pads the hidden-state group's page to the other groups' (gpt-oss-20b's
    shape, 4 captured layers of 2880 in bf16: 1-token blocks, 23,040 bytes of data in
    pages of 32,768): the pitch is the page, the block stays its data."""
    L, H = 4, 2880
    page = 32768 // 2  # elements
    view = layout_from_view((100, L, 1, H), (page, H, H, 1), L, H)
    assert view == ("LTH", 1, page, 1) and view.padded(L, H)
    assert not layout_from_view((100, L, 1, H), (L * H, H, H, 1), L, H).padded(L, H)
    g = BlockLayout("TLH", 1, L, H, "bfloat16")
    assert g.block_bytes == 23040


def test_merge_runs_folds_dense_consecutive_blocks_only() -> None:
    bb = 1000
    dense = [(b * bb, j * bb, bb) for j, b in enumerate([7, 8, 9, 3, 4])]
    assert merge_runs(dense) == [(7 * bb, 0, 3 * bb), (3 * bb, 3 * bb, 2 * bb)]
    padded = [(b * 1500, j * bb, bb) for j, b in enumerate([7, 8, 9])]
    assert merge_runs(padded) == padded
    # LTH: a block's layers go to rows nb apart in the run, never merged across layers
    lth = [(7 * bb + layer * 250, layer * 500, 250) for layer in range(4)]
    assert merge_runs(lth) == lth
    assert merge_runs([]) == []


def test_blocks_for_tokens_follows_the_slot_mapping() -> None:
    bs = 4
    # positions 2..9 in blocks 7 (pos 0-3), 2 (pos 4-7), 5 (pos 8-11)
    slots = [7 * 4 + 2, 7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4, 5 * 4 + 1]
    assert blocks_for_tokens(slots, bs, first_position=2) == [(0, 7), (1, 2), (2, 5)]


def test_blocks_for_tokens_catches_a_wrong_block_size() -> None:
    # Written with block size 16, read assuming 32: offsets disagree.
    slots = [3 * 16 + i for i in range(12)]
    assert blocks_for_tokens(slots, 16, first_position=0) == [(0, 3)]
    with pytest.raises(ValueError, match="does not match"):
        blocks_for_tokens(slots, 32, first_position=0)
    with pytest.raises(ValueError, match="no cache slot"):
        blocks_for_tokens([-1], 8, first_position=0)
