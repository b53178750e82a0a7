"""Block, slot and page arithmetic."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_connector.layout import (
    BlockLayout,
    blocks_for_tokens,
    layout_from_view,
    pages_per_block,
    piece_spans,
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


@given(st.integers(1, 1 << 20), st.integers(64, 1 << 16))
def test_pieces_tile_a_block(block: int, page: int) -> None:
    spans = piece_spans(block, page)
    assert len(spans) == pages_per_block(block, page)
    assert spans[0][0] == 0 and all(n <= page for _, n in spans)
    assert sum(n for _, n in spans) == block
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(spans))


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
    assert layout_from_view((10, L, bs, H), (L * bs * H, bs * H, H, 1), L, H) == ("LTH", bs)
    # GPU: the same view over [nb, bs, L, H] memory.
    assert layout_from_view((10, L, 16, H), (16 * L * H, H, L * H, 1), L, H) == ("TLH", 16)
    # A plain [nb, bs, L, H] tensor.
    assert layout_from_view((10, 16, L, H), (16 * L * H, L * H, H, 1), L, H) == ("TLH", 16)
    # num_layers == block_size: the view convention decides, strides tell the memory order.
    assert layout_from_view((10, 4, 4, H), (16 * H, 4 * H, H, 1), 4, H) == ("LTH", 4)
    assert layout_from_view((10, 4, 4, H), (16 * H, H, 4 * H, 1), 4, H) == ("TLH", 4)
    with pytest.raises(ValueError, match="captured layers"):
        layout_from_view((10, 5, 6, H), (30 * H, 6 * H, H, 1), L, H)
    with pytest.raises(ValueError, match="hidden_size"):
        layout_from_view((10, L, 16, 32), (L * 16 * 32, 16 * 32, 32, 1), L, H)
    with pytest.raises(ValueError, match="not dense"):
        layout_from_view((10, L, bs, H), (2 * L * bs * H, bs * H, H, 1), L, H)


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
