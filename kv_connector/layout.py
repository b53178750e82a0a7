"""Block, slot and page arithmetic: pure functions, no torch, vllm or nixl.

A producer's cache-only layer holds, per cache block, ``block_size`` tokens of
``num_layers`` captured hidden states of ``hidden_size`` elements, in one of two orders
(see ``protocol.LAYOUTS``). A reader's receive pool is cut into pages of ``page_bytes``;
a block that is larger than a page is written as consecutive pieces into several pages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kv_connector.protocol import LAYOUTS, dtype_size


@dataclass(frozen=True)
class BlockLayout:
    """Shape of one cache block of the cache-only layer."""

    layout: str
    block_size: int
    num_layers: int
    hidden_size: int
    dtype: str

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; expected one of {LAYOUTS}")
        for name in ("block_size", "num_layers", "hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        dtype_size(self.dtype)

    @property
    def token_bytes(self) -> int:
        return self.num_layers * self.hidden_size * dtype_size(self.dtype)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block in this layout."""
        if self.layout == "LTH":
            return (self.num_layers, self.block_size, self.hidden_size)
        return (self.block_size, self.num_layers, self.hidden_size)


def layout_from_view(
    shape: Sequence[int], strides: Sequence[int], num_layers: int, hidden_size: int
) -> tuple[str, int]:
    """(layout, block_size) of the cache-only layer's tensor, read from its view.

    vLLM's cache-only layer indexes its cache as [num_blocks, num_layers, block_size,
    hidden] (it writes ``cache[slot // shape[2], :, slot % shape[2]]``); the memory
    behind that view is "LTH" when contiguous (the CPU backend) and "TLH" when the view
    is a permutation of [num_blocks, block_size, num_layers, hidden] (the GPU "LBNHC"
    layout). A plain [num_blocks, block_size, num_layers, hidden] tensor is also read as
    "TLH". Blocks must be dense: ``strides[0]`` is one block.
    """
    if len(shape) != 4 or len(strides) != 4 or shape[3] != hidden_size or strides[3] != 1:
        raise ValueError(
            f"cache-only tensor of shape {tuple(shape)} strides {tuple(strides)} is not "
            f"[num_blocks, ., ., hidden_size={hidden_size}] with unit stride in hidden"
        )
    H = hidden_size
    if shape[1] == num_layers:
        bs = shape[2]
        if strides[1] == bs * H and strides[2] == H:
            layout = "LTH"
        elif strides[2] == num_layers * H and strides[1] == H:
            layout = "TLH"
        else:
            raise ValueError(f"cache-only tensor strides {tuple(strides)} are neither LTH nor TLH")
    elif shape[2] == num_layers and strides[2] == H and strides[1] == num_layers * H:
        bs, layout = shape[1], "TLH"
    else:
        raise ValueError(
            f"cache-only tensor of shape {tuple(shape)} has no dimension of {num_layers} captured layers"
        )
    if strides[0] != bs * num_layers * H:
        raise ValueError(
            f"cache-only tensor blocks are {strides[0]} elements apart, not one block "
            f"({bs * num_layers * H}): blocks are not dense"
        )
    return layout, bs


def pages_per_block(block_bytes: int, page_bytes: int) -> int:
    return math.ceil(block_bytes / page_bytes)


def piece_spans(block_bytes: int, page_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each page-sized piece of one block."""
    return [(off, min(page_bytes, block_bytes - off)) for off in range(0, block_bytes, page_bytes)]


def stripe(num_blocks: int, rank: int, world_size: int) -> range:
    """The block indices rank ``rank`` of ``world_size`` ships: a contiguous, balanced
    share (the first ``num_blocks % world_size`` ranks take one more)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    base, extra = divmod(num_blocks, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def blocks_for_tokens(slots: Sequence[int], block_size: int, first_position: int) -> list[tuple[int, int]]:
    """Map slots written for consecutive token positions (starting at ``first_position``)
    to (block index within the request, cache block id) pairs, checking that each slot
    sits at its position's offset inside its block.

    Raises ValueError when the slots disagree with ``block_size``: that is the mistake that
    made vLLM ship all-zero states, so it is an error, never guessed around.
    """
    out: dict[int, int] = {}
    for i, slot in enumerate(slots):
        pos = first_position + i
        if slot < 0:
            raise ValueError(f"token at position {pos} has no cache slot ({slot})")
        block_id, offset = divmod(slot, block_size)
        if offset != pos % block_size:
            raise ValueError(
                f"slot {slot} of position {pos} is at offset {offset} of its block, "
                f"expected {pos % block_size}: block size {block_size} does not match "
                "the slot mapping"
            )
        j = pos // block_size
        prev = out.setdefault(j, block_id)
        if prev != block_id:
            raise ValueError(f"positions of block {j} map to cache blocks {prev} and {block_id}")
    return sorted(out.items())
