"""The producer reads the hidden-state cache exactly as vLLM lays it out on a GPU.

Each case builds the cache-only layer's tensor with vLLM's own functions (the layout
resolution of the engine core, the KV cache planner, ``prepare_kernel_block_sizes``,
``allocate_kv_cache``), writes captured states into it with vLLM's own cache write
(``basic_cache``) at the slots a manager block table gives, with every other byte of the
shared buffer filled with noise, and reads every sample back through the producer's
reader (``read_cache``, ``CacheBlocks``, ``cache_spans``) and the reader's
``sample_view``: every (block, token, layer) position must come back true. Views that
cannot be read without a guess are refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kv_connector.cache.blocks import CacheBlocks
from kv_connector.producer.planning import BlockRecorder, ShipOrder, StepPlan, StepSlice, in_kernel_blocks
from kv_connector.producer.worker_side import read_cache
from kv_connector.reader.pool.lease import sample_view
from kv_connector.wire.identity import NO_IDENTITY
from kv_connector.wire.layout import AmbiguousCacheView, BlockLayout, cache_spans, kernel_block_ids

pytestmark = pytest.mark.slow

L, H = 3, 128  # captured layers, hidden size
HIDDEN_LAYER = "model.cache_only_layers.4"
ATTN = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _planning() -> Any:
    """vLLM's KV cache planner module (0.33 moved it out of ``kv_cache_utils``)."""
    try:
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:
        from vllm.v1.core import kv_cache_utils as planning
    return planning


class FlashInferDeclared:
    """FlashInfer's declarations as ``v1/attention/backends/flashinfer.py`` makes them
    (importing it needs the flashinfer package): kernel blocks of 16, 32 or 64 tokens,
    and on compute capability 10 the head-major layouts LBHNC then BLHNC."""

    def __init__(self, capability_major: int) -> None:
        self.major = capability_major

    def get_name(self) -> str:
        return "FLASHINFER"

    def get_supported_kernel_block_sizes(self, kv_cache_spec: Any = None) -> list[int]:
        return [16, 32, 64]

    def supported_kv_cache_layouts(self) -> Any:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC) if self.major == 10 else None


def backend(name: str) -> Any:
    if name == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend
    if name == "TRITON_ATTN":
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend
    if name == "FLASHINFER":
        return FlashInferDeclared(9)
    assert name == "FLASHINFER_SM100"
    return FlashInferDeclared(10)


@dataclass(frozen=True)
class Case:
    backend: str
    block_size: int
    peer_layout: str | None = None  # a MultiConnector peer's preferred layout
    forced_layout: str | None = None  # VLLM_KV_CACHE_LAYOUT
    sliding: bool = False  # half the attention layers sliding-window: two attention groups

    def __str__(self) -> str:
        extra = [f"peer={self.peer_layout}"] * bool(self.peer_layout)
        extra += [f"layout={self.forced_layout}"] * bool(self.forced_layout) + ["sliding"] * self.sliding
        return "-".join([self.backend, f"bs{self.block_size}", *extra])


def engine(case: Case, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, list[int], Any]:
    """vLLM's KV cache config, layout and kernel block sizes for a 4-layer Llama shape with
    extract_hidden_states, resolved and planned by vLLM's own functions; and the config."""
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionBackend
    from vllm.v1.attention.backends import utils as backend_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, HiddenStateCacheSpec, SlidingWindowSpec
    from vllm.v1.worker.utils import prepare_kernel_block_sizes

    attn_backend = backend(case.backend)
    bs, dt = case.block_size, torch.bfloat16
    specs: dict[str, Any] = {}
    for i, name in enumerate(ATTN):
        if case.sliding and i % 2:
            specs[name] = SlidingWindowSpec(
                block_size=bs, num_kv_heads=2, head_size=64, dtype=dt, sliding_window=32
            )
        else:
            specs[name] = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=dt)
    specs[HIDDEN_LAYER] = HiddenStateCacheSpec(block_size=bs, num_kv_heads=L, head_size=H, dtype=dt)
    cache_config = SimpleNamespace(
        kv_cache_layout=None,
        num_gpu_blocks_override=None,
        prefix_cache_retention_interval=None,
    )
    cache_config.get_resolved_kv_cache_layout = lambda: _layout(cache_config.kv_cache_layout)
    cfg = SimpleNamespace(
        cache_config=cache_config,
        attention_config=SimpleNamespace(hisparse_config=None),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        model_config=SimpleNamespace(use_mla=False),
        speculative_config=None,
    )
    # the engine core's resolution: the workers' declared layouts, the specs, then an
    # explicit VLLM_KV_CACHE_LAYOUT or the connector's preference
    backends = [attn_backend, CacheOnlyAttentionBackend]
    names = [m.name for m in backend_utils.get_supported_kv_cache_layouts(backends)]
    monkeypatch.setattr(backend_utils, "get_kv_connector_cache_layout", lambda _cfg=None: case.peer_layout)
    if case.forced_layout is not None:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", case.forced_layout)
    else:
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    layout = backend_utils.resolve_kv_cache_layout(cfg, [names], specs.values())  # type: ignore[arg-type]
    planning = _planning()
    groups = planning.get_kv_cache_groups(cfg, specs)
    config = planning.get_kv_cache_config_from_groups(cfg, groups, 64 << 20)
    attn_groups = [
        [
            SimpleNamespace(
                backend=CacheOnlyAttentionBackend
                if HIDDEN_LAYER in g.layer_names and len(g.layer_names) == 1
                else b,
                kv_cache_spec=s,
            )
            for b, s in _group_backends(g, attn_backend, CacheOnlyAttentionBackend)
        ]
        for g in config.kv_cache_groups
    ]
    kernel_sizes = prepare_kernel_block_sizes(config, attn_groups)  # type: ignore[arg-type]
    return config, layout, kernel_sizes, cfg


def _layout(name: str | None) -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert name is not None
    return KVCacheLayout[name]


def _group_backends(group: Any, attn: Any, cache_only: Any) -> list[tuple[Any, Any]]:
    """(backend, spec) of each attention group inside a KV cache group, as the model
    runner forms them: one per backend and spec."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    layer_specs = (
        spec.kv_cache_specs
        if isinstance(spec, UniformTypeKVCacheSpecs)
        else dict.fromkeys(group.layer_names, spec)
    )
    out: list[tuple[Any, Any]] = []
    for s in dict.fromkeys(layer_specs.values()):
        out.append((cache_only if isinstance(s, HiddenStateCacheSpec) else attn, s))
    return out


def allocate(config: Any, layout: Any, kernel_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden-state layer's view as vLLM allocates it, and the shared buffer behind
    every layer, filled with noise."""
    from vllm.v1.worker.utils import allocate_kv_cache

    caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_sizes)
    hs = caches[HIDDEN_LAYER]
    buf = torch.empty(0, dtype=torch.uint8).set_(hs.untyped_storage())
    buf.copy_(torch.randint(1, 255, buf.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    return hs, buf


def write_requests(
    hs: torch.Tensor, manager_bs: int, tables: Sequence[Sequence[int]], lengths: Sequence[int]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each request's states written by vLLM's own cache write at the slots its manager
    block table gives (``slot = block * block_size + position % block_size``); returns
    the states and the step's slot mapping."""
    from vllm.model_executor.models.extract_hidden_states import basic_cache

    gen = torch.Generator().manual_seed(11)
    states, slots = [], []
    for table, n in zip(tables, lengths, strict=True):
        s = torch.randn(n, L, H, generator=gen).to(torch.bfloat16)
        pos = torch.arange(n)
        slot = torch.tensor(table)[pos // manager_bs] * manager_bs + pos % manager_bs
        basic_cache(s, hs, slot)
        states.append(s)
        slots.append(slot)
    return states, torch.cat(slots)


def read_back(hs: torch.Tensor, config: Any, table: Sequence[int], n: int) -> torch.Tensor:
    """A sample as the producer ships it and the reader views it: the cache read with
    ``read_cache``, the sample's blocks as ``CacheBlocks.share_of`` picks them, its
    bytes moved span by span as a WRITE moves them, viewed with ``sample_view``."""
    view = read_cache(hs, L, H, config)
    geometry = BlockLayout(view.layout, view.block_size, L, H, "bfloat16")
    blocks = CacheBlocks(hs, geometry)
    share = blocks.share_of(
        "req", list(range(n)), kernel_block_ids(table, view.kernel_blocks), [1, 2, 3], NO_IDENTITY, 0, 1
    )
    m = share.manifest
    run = torch.zeros(geometry.sample_bytes(m.num_blocks), dtype=torch.uint8)
    for src, dst, length in cache_spans(geometry, m.num_blocks, share.block_ids, share.share, blocks.pitch):
        run[dst : dst + length] = blocks.raw[src : src + length]
    return sample_view(run, m)


CASES = [
    Case("FLASH_ATTN", 16),
    Case("FLASH_ATTN", 64),
    Case("TRITON_ATTN", 16),
    Case("TRITON_ATTN", 32, forced_layout="LBHNC"),
    Case("FLASHINFER", 16),
    Case("FLASHINFER", 128),  # kernel blocks of 64 in 128-token manager blocks
    Case("FLASHINFER_SM100", 128),  # LBHNC, and split: each manager block is two LTH blocks
    Case("FLASHINFER_SM100", 32, forced_layout="BLHNC"),  # block-outermost: a shared, padded page
    Case("FLASH_ATTN", 16, forced_layout="BLNHC"),
    Case("FLASH_ATTN", 16, peer_layout="LBHNC"),  # a MultiConnector peer (NixlConnector) prefers LBHNC
    Case("FLASHINFER", 128, peer_layout="LBHNC"),
    Case("FLASH_ATTN", 16, sliding=True),  # two attention groups and the hidden-state group
    Case("FLASHINFER_SM100", 64, sliding=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_position_reads_back_true(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    config, layout, kernel_sizes, _ = engine(case, monkeypatch)
    gid = next(i for i, g in enumerate(config.kv_cache_groups) if HIDDEN_LAYER in g.layer_names)
    manager_bs = config.kv_cache_groups[gid].kv_cache_spec.block_size
    hs, _ = allocate(config, layout, kernel_sizes)
    view = read_cache(hs, L, H, config)
    assert view.block_size == kernel_sizes[gid] and view.kernel_blocks == manager_bs // kernel_sizes[gid]
    assert hs.shape[0] == config.num_blocks * view.kernel_blocks
    # tables out of order, blocks shared by no two requests, tails part-filled
    n = config.num_blocks
    tables = [[n - 2, 3, 5], [1], [n - 1, 2, 4, 6]]
    lengths = [2 * manager_bs + 1, manager_bs, 3 * manager_bs + manager_bs // 2]
    states, slots = write_requests(hs, manager_bs, tables, lengths)
    for table, k, want in zip(tables, lengths, states, strict=True):
        got = read_back(hs, config, table, k)
        assert got.shape == want.shape
        assert torch.equal(got, want), f"{case}: {layout.name} read {int((got != want).sum())} values wrong"
    # the worker's slot check agrees with the slots vLLM wrote, in the tensor's blocks
    rec = BlockRecorder(view.block_size)
    plan = in_kernel_blocks(
        StepPlan(
            slices=[
                StepSlice(f"r{i}", 0, k, tuple(t))
                for i, (t, k) in enumerate(zip(tables, lengths, strict=True))
            ],
            ships=[
                ShipOrder(f"r{i}", tuple(range(k)), tuple(t))
                for i, (t, k) in enumerate(zip(tables, lengths, strict=True))
            ],
        ),
        view.kernel_blocks,
    )
    assert rec.record(slots.tolist(), plan.slices) == {}
    for order in plan.ships:
        assert rec.ship_blocks(len(order.token_ids), order.block_ids) == list(
            order.block_ids[: -(-len(order.token_ids) // view.block_size)]
        )


def test_cases_cover_each_layout_and_a_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cases above reach both orders in a block, padded pages and kernel splits of
    both orders (a guard on the table, not on vLLM)."""
    seen = set()
    for case in CASES:
        config, layout, kernel_sizes, _ = engine(case, monkeypatch)
        hs, _ = allocate(config, layout, kernel_sizes)
        view = read_cache(hs, L, H, config)
        seen.add((layout.name, view.layout, view.kernel_blocks > 1, view.padded(L, H)))
    kinds = {(order, split) for _, order, split, _ in seen}
    assert {("LTH", True), ("TLH", True), ("LTH", False), ("TLH", False)} <= kinds
    assert any(padded for *_, padded in seen)
    assert {name for name, *_ in seen} >= {"LBNHC", "LBHNC", "BLHNC", "BLNHC"}


@pytest.mark.parametrize("name", ["LHBNC", "BHLNC"])
def test_layouts_that_part_a_blocks_planes_are_refused(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's layer-major-across-blocks layouts (a single-group model may get them by
    VLLM_KV_CACHE_LAYOUT): a block is not one dense run, refused by name."""
    from vllm.v1.kv_cache_interface import (
        HiddenStateCacheSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    spec = HiddenStateCacheSpec(block_size=16, num_kv_heads=L, head_size=H, dtype=torch.bfloat16)
    layout = _layout(name)
    nb = 8
    layer_stride, block_stride, *_ = compute_layout_strides(spec, nb, 2, layout)
    tensor = KVCacheTensor(
        size=2 * nb * spec.page_size_bytes,
        layers=[HIDDEN_LAYER, "other"],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    hs, _ = create_kv_cache_views(raw, spec, nb, layout, tensor)
    config = KVCacheConfig(
        num_blocks=nb,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec([HIDDEN_LAYER, "other"], spec)],
    )
    with pytest.raises(AmbiguousCacheView, match="LHBNC or BHLNC"):
        read_cache(hs, L, H, config)


def test_a_kernel_granular_view_is_not_read_as_manager_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split view's first stride is a kernel block's: read against a config whose
    block count or block size does not account for it, it is refused, never guessed."""
    config, layout, kernel_sizes, _ = engine(Case("FLASHINFER", 128), monkeypatch)
    hs, _ = allocate(config, layout, kernel_sizes)
    assert hs.shape[0] == 2 * config.num_blocks  # 64-token kernel blocks
    shape, strides = hs.shape, hs.stride()
    from kv_connector.wire.layout import layout_from_view

    with pytest.raises(AmbiguousCacheView, match="block pitch cannot be told"):
        layout_from_view(shape, strides, L, H, 64, config.num_blocks)  # the split unaccounted for
    with pytest.raises(AmbiguousCacheView, match="do not divide"):
        layout_from_view(shape, strides, L, H, 96, config.num_blocks)
    with pytest.raises(AmbiguousCacheView, match="captured layers"):
        layout_from_view(shape, strides, L + 1, H, 128, config.num_blocks)
    assert layout_from_view(shape, strides, L, H, 128, config.num_blocks).kernel_blocks == 2
