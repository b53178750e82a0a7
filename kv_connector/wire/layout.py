"""Block geometry: the one home of block, slot, span and page arithmetic. Pure logic.

A producer's cache-only layer holds, per cache block, ``block_size`` tokens of ``num_layers``
captured hidden states of ``hidden_size`` elements, in one of two orders (``Layout``).
``BlockLayout`` is that shape as a typed wire record. It travels in every manifest, so the
reader rebuilds a sample from exactly what the producer's cache holds.

A reader's receive pool is cut into pages, and each sample gets one contiguous run of them.
Its blocks are arranged so the whole sample is one tensor view (``arranged_spans``). TLH
blocks lie one after the other, a plain [T, L, H] tensor. LTH blocks lie layer by layer,
[L, T, H] in memory, a strided [T, L, H] view.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Annotated, Literal, NamedTuple, get_args

import msgspec

from kv_connector.common.errors import ConfigurationError, IntegrityError

# Order of the dimensions inside one cache block of the cache-only layer.
# "LTH": [num_layers, block_size, hidden] (vLLM's CPU layout).
# "TLH": [block_size, num_layers, hidden] (vLLM's GPU layout).
Layout = Literal["LTH", "TLH"]
DType = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
MAX_LAYERS = 1024
MAX_BLOCK_SIZE = 1 << 16
MAX_HIDDEN = 1 << 20


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks of ``block_size`` tokens hold ``num_tokens`` tokens."""
    if block_size <= 0:
        raise ConfigurationError(f"block size must be positive, got {block_size}")
    return -(-num_tokens // block_size)


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ConfigurationError(
            f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPE_SIZES)}"
        ) from None


class BlockLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape of one cache block of the cache-only layer (also a wire record: it is
    validated when decoded, and when built)."""

    layout: Layout
    block_size: Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCK_SIZE)]
    num_layers: Annotated[int, msgspec.Meta(gt=0, le=MAX_LAYERS)]
    hidden_size: Annotated[int, msgspec.Meta(gt=0, le=MAX_HIDDEN)]
    dtype: DType

    def __post_init__(self) -> None:
        # msgspec checks the annotations when decoding; a layout built in Python is
        # checked here (and a failure here is a ValidationError when decoding)
        if self.layout not in LAYOUTS:
            raise ConfigurationError(f"unknown layout {self.layout!r}; expected one of {LAYOUTS}")
        for name, top in (
            ("block_size", MAX_BLOCK_SIZE),
            ("num_layers", MAX_LAYERS),
            ("hidden_size", MAX_HIDDEN),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= top:
                raise ConfigurationError(f"{name} must be an integer in 1..{top}, got {v!r}")
        dtype_size(self.dtype)

    @property
    def item_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """One token's one layer: ``hidden_size * itemsize``."""
        return self.hidden_size * self.item_size

    @property
    def token_bytes(self) -> int:
        return self.num_layers * self.row_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block in this layout."""
        if self.layout == "LTH":
            return (self.num_layers, self.block_size, self.hidden_size)
        return (self.block_size, self.num_layers, self.hidden_size)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def sample_bytes(self, num_blocks: int) -> int:
        """Bytes a sample of ``num_blocks`` blocks takes in the reader's pool."""
        return num_blocks * self.block_bytes

    def arranged_spans(self, num_blocks: int, block: int) -> list[tuple[int, int, int]]:
        """(offset in the cache block, offset in the sample's run, length) of each piece of block ``block``.

        This is where the reader's pool holds a ``num_blocks``-block sample. TLH blocks lie one
        after the other, a run of [num_blocks * block_size, L, H]. LTH is layer-major: layer l of
        block ``block`` starts at row (l * num_blocks + block) * block_size of an [L, T, H] run. Either is one
        [T, L, H] view.
        """
        if not 0 <= block < num_blocks:
            raise ConfigurationError(f"block {block} outside the sample's {num_blocks} blocks")
        if self.layout == "TLH":
            return [(0, block * self.block_bytes, self.block_bytes)]
        seg = self.block_size * self.row_bytes
        return [(layer * seg, (layer * num_blocks + block) * seg, seg) for layer in range(self.num_layers)]

    def arranged(self, num_blocks: int, block: int, off: int, nbytes: int) -> list[tuple[int, int]]:
        """Where bytes ``off .. off + nbytes`` of block ``block`` lie in the sample's run:
        (offset in the run, length) pieces, split where the arrangement splits the block."""
        out = []
        for src, dst, length in self.arranged_spans(num_blocks, block):
            lo, hi = max(off, src), min(off + nbytes, src + length)
            if lo < hi:
                out.append((dst + lo - src, hi - lo))
        return out

    def valid_spans(self, num_tokens: int, block_index: int) -> list[tuple[int, int]]:
        """(offset, length) of the bytes holding the sample's tokens inside block ``block_index``.

        That is the whole block except the last block's tail, where vLLM goes on writing decode
        tokens.
        """
        first = block_index * self.block_size
        k = min(self.block_size, num_tokens - first)
        if k <= 0:
            raise ConfigurationError(f"block {block_index} holds none of the sample's {num_tokens} tokens")
        if self.layout == "TLH" or k == self.block_size:
            return [(0, k * self.num_layers * self.row_bytes)]
        return [
            (layer * self.block_size * self.row_bytes, k * self.row_bytes) for layer in range(self.num_layers)
        ]


class CacheView(NamedTuple):
    """What the producer reads off the cache-only layer's tensor: order, block size, pitch and split.

    ``block_pitch`` is the elements from one block's start to the next. It exceeds one block
    where vLLM pads each block to a page shared with other KV cache groups: models mixing
    sliding-window and full attention, Mamba-only models, block-outermost layouts. The padding is
    never shipped, and only dense blocks merge into one descriptor. ``kernel_blocks`` exceeds one
    where vLLM splits each manager block into kernel blocks for the attention backend
    (``block_size > kernel_block_size``). The producer then reads in its own kernel blocks.
    """

    layout: Layout
    block_size: int
    block_pitch: int
    kernel_blocks: int = 1

    def padded(self, num_layers: int, hidden_size: int) -> bool:
        return self.block_pitch != self.block_size * num_layers * hidden_size


class AmbiguousCacheView(ConfigurationError):
    """The cache-only layer's tensor admits more than one reading, or none that is
    sound: the producer refuses it at registration and never reads it."""


def layout_from_view(
    shape: Sequence[int],
    strides: Sequence[int],
    num_layers: int,
    hidden_size: int,
    manager_block_size: int | None = None,
    num_blocks: int | None = None,
) -> CacheView:
    """(layout, block_size, block_pitch, kernel_blocks) of the cache-only layer's tensor, read from its view.

    ``AmbiguousCacheView`` names what makes a view unreadable. vLLM (0.32, 0.33) hands every
    layer a view of logical shape [B, H, N, C]: blocks, heads (the captured layers), tokens,
    content (hidden). It is a permutation over a shared buffer (``create_kv_cache_views``), and
    the cache-only layer writes through it as ``cache[slot // shape[2], :, slot % shape[2]]``.

    So dimension 1 must hold the captured layers and dimension 2 a block's tokens. The strides
    say where each layer's plane lies: one after the other inside a block ("LTH": vLLM's LBHNC
    and BLHNC) or interleaved token by token ("TLH": LBNHC and BLNHC). Layouts that put other
    blocks or layers between a block's planes (LHBNC, BHLNC) are refused. ``strides[0]`` is the
    blocks' pitch, at least one dense block.

    Where vLLM splits manager blocks of ``manager_block_size`` tokens into kernel blocks, the
    view has ``shape[2]`` tokens a block and ``num_blocks * kernel_blocks`` blocks.
    ``kernel_blocks`` is that split, checked against ``num_blocks`` where it is given. Without
    ``manager_block_size`` the view is taken as manager-granular.
    """
    if len(shape) != 4 or len(strides) != 4 or shape[3] != hidden_size or strides[3] != 1:
        raise AmbiguousCacheView(
            f"cache-only tensor of shape {tuple(shape)} strides {tuple(strides)} is not "
            f"[num_blocks, ., ., hidden_size={hidden_size}] with unit stride in hidden"
        )
    H, L = hidden_size, num_layers
    if shape[1] != L:
        raise AmbiguousCacheView(
            f"cache-only tensor of shape {tuple(shape)}: dimension 1 holds {shape[1]}, not the "
            f"{L} captured layers vLLM's cache-only layer writes there ([num_blocks, layers, "
            "block, hidden]); reading it another way would be a guess"
        )
    bs = shape[2]
    layout: Layout
    # one captured layer or one token a block: both orders are the same bytes
    if strides[2] == H and (strides[1] == bs * H or L == 1):
        layout = "LTH"
    elif strides[1] == H and (strides[2] == L * H or bs == 1):
        layout = "TLH"
    else:
        where = "blocks" if shape[0] > 1 and strides[1] > strides[0] else "other layers' pages"
        raise AmbiguousCacheView(
            f"cache-only tensor strides {tuple(strides)} (shape {tuple(shape)}) keep a block's "
            f"{L} planes apart, with {where} between them (vLLM's LHBNC or BHLNC layout): a "
            "block is not one dense run, neither LTH nor TLH"
        )
    block = bs * L * H
    if strides[0] < block and shape[0] > 1:
        raise AmbiguousCacheView(
            f"cache-only tensor blocks are {strides[0]} elements apart, less than one block "
            f"({block}): blocks overlap"
        )
    kernel_blocks = 1
    if manager_block_size is not None and manager_block_size != bs:
        if manager_block_size % bs:
            raise AmbiguousCacheView(
                f"cache-only tensor blocks of {bs} tokens do not divide the KV cache manager's "
                f"{manager_block_size}-token blocks: the tensor's blocks cannot be told from the "
                "block table's"
            )
        kernel_blocks = manager_block_size // bs
    if num_blocks is not None and shape[0] != num_blocks * kernel_blocks:
        raise AmbiguousCacheView(
            f"cache-only tensor has {shape[0]} blocks of {bs} tokens; the KV cache manager has "
            f"{num_blocks} of {manager_block_size or bs}, so {num_blocks * kernel_blocks} were "
            "expected: its block pitch cannot be told"
        )
    return CacheView(layout, bs, max(strides[0], block), kernel_blocks)


def kernel_block_ids(block_ids: Sequence[int], kernel_blocks: int) -> list[int]:
    """A block table of manager blocks as the tensor's kernel blocks.

    vLLM splits manager block ``b`` into the consecutive kernel blocks from ``b * kernel_blocks``.
    """
    if kernel_blocks == 1:
        return list(block_ids)
    return [b * kernel_blocks + i for b in block_ids for i in range(kernel_blocks)]


def merge_runs(rows: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, length) rows, each folded into the previous if it continues it.

    Consecutive dense blocks of a TLH cache, written one after the other into a sample's run,
    become one descriptor. Padded blocks never continue each other, so they stay a row each.
    """
    out: list[tuple[int, int, int]] = []
    for src, dst, n in rows:
        if out:
            s0, d0, n0 = out[-1]
            if s0 + n0 == src and d0 + n0 == dst:
                out[-1] = (s0, d0, n0 + n)
                continue
        out.append((src, dst, n))
    return out


def cache_spans(
    geometry: BlockLayout, num_blocks: int, block_ids: Sequence[int], share: Iterable[int], pitch: int
) -> list[tuple[int, int, int]]:
    """(cache offset, run offset, length) of every piece of the blocks ``share`` of a sample.

    Block ``j`` of the ``num_blocks``-block sample is cache block ``block_ids[j]``, and blocks
    are ``pitch`` bytes apart. These are what a WRITE (push) or a READ (pull) moves; pieces
    that continue each other on both sides are merged (``merge_runs``).
    """
    return merge_runs(
        (block_ids[j] * pitch + src, dst, n)
        for j in share
        for src, dst, n in geometry.arranged_spans(num_blocks, j)
    )


def pages_for(nbytes: int, page_bytes: int) -> int:
    """Pages of ``page_bytes`` that hold ``nbytes``."""
    return -(-nbytes // page_bytes)


def stripe(num_blocks: int, rank: int, world_size: int) -> range:
    """The block indices rank ``rank`` of ``world_size`` ships: a contiguous, balanced
    share (the first ``num_blocks % world_size`` ranks take one more)."""
    if not 0 <= rank < world_size:
        raise ConfigurationError(f"rank {rank} outside world size {world_size}")
    base, extra = divmod(num_blocks, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def blocks_for_tokens(slots: Sequence[int], block_size: int, first_position: int) -> list[tuple[int, int]]:
    """(block index within the request, cache block id) of slots written for consecutive positions.

    Positions start at ``first_position``, and each slot must sit at its position's offset
    inside its block. ValueError when the slots disagree with ``block_size``: that mistake once
    made vLLM ship all-zero states, so it is an error, never guessed around.
    """
    out: dict[int, int] = {}
    for i, slot in enumerate(slots):
        pos = first_position + i
        if slot < 0:
            raise IntegrityError(f"token at position {pos} has no cache slot ({slot})")
        block_id, offset = divmod(slot, block_size)
        if offset != pos % block_size:
            raise IntegrityError(
                f"slot {slot} of position {pos} is at offset {offset} of its block, "
                f"expected {pos % block_size}: block size {block_size} does not match "
                "the slot mapping"
            )
        j = pos // block_size
        prev = out.setdefault(j, block_id)
        if prev != block_id:
            raise IntegrityError(f"positions of block {j} map to cache blocks {prev} and {block_id}")
    return sorted(out.items())
