"""KV cache figures of a hybrid model with hidden-state extraction, computed by vLLM's own functions.

Three approaches are compared without weights: vLLM's own group, the supplementary tensor
the plugin installs (``plan_kv_cache_configs``), and no extraction. vLLM's ``EngineArgs``
builds a real ``VllmConfig`` from a config.json written for the shape
(``HybridShape.standin_config``). ``Platform._align_hybrid_block_size`` aligns the attention
block to the linear-attention state, with the chosen platform's backend. Each layer's spec
comes from vLLM's spec classes as the layer builds it, and the cache-only layer's from vLLM's
``ExtractHiddenStatesModel``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
)

from hybrid import versions
from hybrid.host import cpu_isa
from hybrid.shapes import FULL, SLIDING, HybridShape
from hybrid.spec import (
    NoAttentionGroupError,
    SupplementedKVCacheConfig,
    attention_group_index,
    plan_kv_cache_configs,
)
from kv_connector.common.errors import ConfigurationError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionBackend

PLATFORMS = ("cuda", "cpu")
ALIGNMENT = {
    "cuda": "FlashAttention, 16-token kernel blocks",
    "cpu": "CPU attention, 128-token blocks, SSM state dtype of this host's CPU",
}


@dataclass(frozen=True)
class Setup:
    """What the figures are computed for, besides the model's shape.

    ``platform``: whose attention backend and block alignment. "cuda" is FlashAttention with
    16-token kernel blocks, independent of the host. "cpu" is vLLM's CPU build on this host, whose
    SSM state dtype and block size depend on the CPU's instruction set (``hybrid.host``).
    ``block_size``: the target's attention block size when known, such as read off its log.
    None takes the one vLLM's alignment picks; a block too small for the state is rounded up,
    as vLLM does at start.
    """

    layer_ids: tuple[int, ...]
    budget_bytes: int
    max_model_len: int = 32768
    platform: str = "cuda"
    prefix_caching: bool = True
    block_size: int | None = None
    sample_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ConfigurationError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")
        if self.budget_bytes <= 0 or self.max_model_len <= 0:
            raise ConfigurationError("budget and max model length must be positive")
        if self.sample_tokens <= 0:
            raise ConfigurationError(f"sample tokens must be positive, got {self.sample_tokens}")
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigurationError(f"block size must be positive, got {self.block_size}")


@dataclass(frozen=True)
class GroupFigures:
    kind: str
    layers: int
    block_size: int
    page_bytes: int
    blocks_per_request: int


@dataclass
class Figures:
    """One approach's figures.

    ``bytes_per_block`` counts every tensor, groups and supplementary.
    ``hidden_state_bytes_per_block`` is what the hidden states cost per attention block; in
    vLLM's approach, the pool blocks its own group spends on one attention block's tokens.
    ``token_capacity`` is vLLM's count of tokens of ``max_model_len``-long requests that fit,
    with blocks per request summed over every group as its scheduler allocates them.
    ``shipping``: what one sample of ``Setup.sample_tokens`` costs the connector.
    """

    block_size: int = 0
    num_blocks: int = 0
    bytes_per_block: int = 0
    hidden_state_bytes_per_block: int = 0
    hidden_state_bytes_needed_per_block: int = 0
    token_capacity: int = 0
    max_concurrency: float = 0.0
    blocks_per_request: int = 0
    groups: list[GroupFigures] = field(default_factory=list)
    supplementary: list[dict[str, Any]] = field(default_factory=list)
    shipping: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"max_concurrency": round(self.max_concurrency, 4)}


@contextmanager
def engine_config(shape: HybridShape, setup: Setup, extraction: bool = True) -> Iterator[VllmConfig]:
    """vLLM's config for this shape (stand-in Qwen3-Next config.json in a temporary
    directory that lives as long as the context), block size aligned for the platform."""
    from vllm.engine.arg_utils import EngineArgs

    with tempfile.TemporaryDirectory(prefix="hybrid-report-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(shape.standin_config()))
        spec_config = (
            {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": list(setup.layer_ids)}
                },
            }
            if extraction
            else None
        )
        args = EngineArgs(
            model=tmp,
            skip_tokenizer_init=True,
            max_model_len=setup.max_model_len,
            dtype=cast(Any, shape.dtype),
            enable_prefix_caching=setup.prefix_caching,
            mamba_ssm_cache_dtype=cast(Any, shape.mamba_ssm_dtype or "auto"),
            speculative_config=spec_config,
        )
        env = dict(os.environ)
        try:
            vllm_config = args.create_engine_config()
        finally:
            # vLLM's CPU platform sets process-wide variables when it checks a config
            # (LD_PRELOAD, VLLM_SSM_CONV_STATE_LAYOUT, ...): a report must not change the
            # environment that later vLLM processes of the caller inherit
            os.environ.clear()
            os.environ.update(env)
        if setup.platform == "cuda":
            # vLLM applied the host's platform (the CPU build here), which on a CPU with
            # AVX-512 BF16 turns the SSM state to float32 for its own kernels; a CUDA
            # target keeps the dtype asked for. Figures for CUDA must not depend on
            # where the report runs.
            vllm_config.cache_config.mamba_ssm_cache_dtype = cast(Any, shape.mamba_ssm_dtype or "auto")
        align_block_size(vllm_config, setup.platform, setup.block_size, bool(shape.linear_attention_layers))
        yield vllm_config


def attention_backend(platform: str) -> tuple[type[AttentionBackend], int]:
    """(attention backend class, block size before alignment) vLLM uses on a platform.

    CUDA takes FlashAttention with the default 16-token block, the CPU its backend with 128.
    """
    if platform == "cuda":
        from vllm.config.cache import CacheConfig
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend, CacheConfig.DEFAULT_BLOCK_SIZE
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend, 128


def align_block_size(
    vllm_config: VllmConfig, platform: str, block_size: int | None = None, state_layers: bool = True
) -> None:
    """Set the attention block size and the state page padding as vLLM's platform does for a hybrid model.

    It starts from ``block_size`` (the target's, when given) or the platform's default. A model
    without state layers (gpt-oss) keeps that block.
    """
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionBackend
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    backend, default_block = attention_backend(platform)
    cache = vllm_config.cache_config
    cache.block_size = block_size or default_block
    cache.mamba_page_size_padded = None
    with set_current_vllm_config(vllm_config):
        if state_layers:
            Platform._align_hybrid_block_size(vllm_config, backend)
        layouts = get_supported_kv_cache_layouts([backend, CacheOnlyAttentionBackend])
    cache.kv_cache_layout = layouts[0].name


def layer_specs(vllm_config: VllmConfig, shape: HybridShape, platform: str) -> dict[str, KVCacheSpec]:
    """Every layer's spec as the model's layers report it (MambaBase and Attention
    ``get_kv_cache_spec``), plus the cache-only layer when extraction is on."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.worker.utils import customize_attention_spec

    model_config = vllm_config.model_config
    cache = vllm_config.cache_config
    backend, _ = attention_backend(platform)
    kv = dict(
        block_size=cache.block_size,
        num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model_config.get_head_size(),
        dtype=kv_cache_dtype_str_to_dtype(cache.cache_dtype, model_config),
    )
    with set_current_vllm_config(vllm_config):
        attention = customize_attention_spec(backend, FullAttentionSpec(**kv))  # type: ignore[arg-type]
        sliding = customize_attention_spec(
            backend,
            SlidingWindowSpec(**kv, sliding_window=max(shape.sliding_window, 1)),  # type: ignore[arg-type]
        )
    state = state_spec(vllm_config) if shape.linear_attention_layers else None
    specs: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(shape.layer_types):
        if kind == FULL:
            specs[f"model.layers.{i}.self_attn.attn"] = attention
        elif kind == SLIDING:
            specs[f"model.layers.{i}.self_attn.attn"] = sliding
        else:
            assert state is not None
            specs[f"model.layers.{i}.linear_attn"] = state
    if vllm_config.speculative_config is not None:
        specs.update(cache_only_specs(vllm_config))
    return specs


def state_spec(vllm_config: VllmConfig) -> MambaSpec:
    """A gated-delta-net layer's spec, its state shapes and dtypes as the model's
    (IsHybrid) class computes them."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    model_config, cache = vllm_config.model_config, vllm_config.cache_config
    model_cls: Any = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)[0]
    assert cache.mamba_block_size is not None
    return MambaSpec(
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
        dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=0 if cache.use_replayssm else vllm_config.num_speculative_tokens,
    )


def cache_only_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """The spec of vLLM's own extract_hidden_states cache-only layer, built by vLLM."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.models.extract_hidden_states import (
        CacheOnlyAttentionLayer,
        ExtractHiddenStatesModel,
    )

    with set_current_vllm_config(vllm_config):
        model = ExtractHiddenStatesModel(vllm_config=vllm_config)
    layers = [cast(CacheOnlyAttentionLayer, m) for m in model.cache_only_layers.values()]
    return {str(layer.layer_name): layer.get_kv_cache_spec(vllm_config) for layer in layers}


def figures(
    vllm_config: VllmConfig,
    config: KVCacheConfig,
    hidden_token_bytes: int,
    ship: tuple[int, int, str] | None = None,
) -> Figures:
    """Read an approach's figures off the KV cache config vLLM (or the design) built;
    with ``ship`` (captured layers, sample tokens, platform), its shipping figures."""
    from vllm.v1.core import kv_cache_utils as kcu

    groups = config.kv_cache_groups
    regular = [g for g in groups if not isinstance(_layer_spec(g.kv_cache_spec), HiddenStateCacheSpec)]
    try:
        att = regular[attention_group_index(regular)]
    # a state-only model: its hidden-state group's block, or its state's
    except NoAttentionGroupError:
        att = ([g for g in groups if g not in regular] or groups)[0]
    fig = Figures(block_size=att.kv_cache_spec.block_size, num_blocks=config.num_blocks)
    pool_bytes = versions.pool_bytes_per_block(vllm_config, groups)
    fig.bytes_per_block = pool_bytes
    fig.hidden_state_bytes_needed_per_block = fig.block_size * hidden_token_bytes
    for g in groups:
        spec = g.kv_cache_spec
        per_request = cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)
        layer_spec = _layer_spec(spec)
        kind = (
            "hidden_states"
            if isinstance(layer_spec, HiddenStateCacheSpec)
            else get_kv_cache_spec_kind(spec).value
        )
        fig.groups.append(
            GroupFigures(kind, len(g.layer_names), spec.block_size, spec.page_size_bytes, per_request)
        )
        fig.blocks_per_request += per_request
        if kind == "hidden_states":
            # pool blocks of this group per attention block, each a whole pool block
            fig.hidden_state_bytes_per_block = pool_bytes * fig.block_size // spec.block_size
    if isinstance(config, SupplementedKVCacheConfig):
        for name, spec in config.supplementary_specs.items():
            fig.supplementary.append(
                {
                    "layer": name,
                    "page_bytes": spec.page_size_bytes,
                    "tensor_bytes": spec.page_size_bytes * config.num_blocks,
                    "addressed_by_group": config.supplementary_group,
                }
            )
        fig.bytes_per_block += config.supplementary_bytes_per_block
        fig.hidden_state_bytes_per_block = config.supplementary_bytes_per_block
    fig.token_capacity, fig.max_concurrency = kcu.get_kv_cache_capacity(vllm_config, config)
    if ship is not None:
        fig.shipping = shipping_figures(vllm_config, config, pool_bytes, *ship)
    return fig


def shipping_figures(
    vllm_config: VllmConfig, config: KVCacheConfig, pool_bytes: int, layers: int, tokens: int, platform: str
) -> dict[str, Any]:
    """What one sample of ``tokens`` tokens costs the connector.

    It counts the hidden states' blocks, each ``pitch`` bytes from the next, and the NIXL
    descriptors the sender posts when no two blocks are consecutive. That is one per block in
    the GPU's TLH order and one per layer and block in the CPU's LTH order. It also counts the
    bytes shipped and the cache memory the sample holds until shipped: a supplementary tensor's
    pages, or whole pool blocks in a group of its own.
    """
    if isinstance(config, SupplementedKVCacheConfig) and config.supplementary_specs:
        spec: KVCacheSpec = next(iter(config.supplementary_specs.values()))
        pitch = held = spec.page_size_bytes
    else:
        (group,) = [
            g
            for g in config.kv_cache_groups
            if isinstance(_layer_spec(g.kv_cache_spec), HiddenStateCacheSpec)
        ]
        spec = _layer_spec(group.kv_cache_spec)
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        pitch = pool_bytes if layout.is_block_outermost else spec.page_size_bytes
        held = pool_bytes
    assert isinstance(spec, HiddenStateCacheSpec)
    token_bytes = spec.num_kv_heads * spec.head_size * spec.dtype.itemsize
    blocks = cdiv(tokens, spec.block_size)
    return {
        "sample_tokens": tokens,
        "block_tokens": spec.block_size,
        "block_data_bytes": spec.block_size * token_bytes,
        "block_pitch_bytes": pitch,
        "padded": pitch != spec.block_size * token_bytes,
        "blocks": blocks,
        "descriptors_at_most": blocks * (1 if platform == "cuda" else layers),
        "bytes_shipped": tokens * token_bytes,
        "cache_bytes_held": blocks * held,
    }


def _layer_spec(spec: KVCacheSpec) -> KVCacheSpec:
    return spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec


def approach(
    vllm_config: VllmConfig,
    specs: dict[str, KVCacheSpec],
    budget: int,
    hidden_token_bytes: int,
    ours: bool,
    ship: tuple[int, int, str] | None = None,
) -> Figures:
    """Figures of vLLM's approach (``ours=False``) or of the design, at ``budget``; a
    model the design leaves to vLLM (no full-attention group) gets vLLM's figures."""
    try:
        if ours:
            (config,) = plan_kv_cache_configs(vllm_config, [dict(specs)], [budget])
        else:
            (config,) = versions.kv_cache_configs(vllm_config, [dict(specs)], [budget])
    except ValueError as e:
        return Figures(refused=str(e).split(". Try")[0])
    return figures(vllm_config, config, hidden_token_bytes, ship)


def compare(shape: HybridShape, setup: Setup) -> dict[str, Any]:
    """``{"ours", "vllm", "no_extraction", "setup"}``: the report's JSON object."""
    token_bytes = shape.hidden_state_token_bytes(len(setup.layer_ids))
    with engine_config(shape, setup) as cfg:
        specs = layer_specs(cfg, shape, setup.platform)
        ship = (len(setup.layer_ids), setup.sample_tokens, setup.platform)
        vllm = approach(cfg, specs, setup.budget_bytes, token_bytes, ours=False, ship=ship)
        ours = approach(cfg, specs, setup.budget_bytes, token_bytes, ours=True, ship=ship)
        info = {
            "model": shape.architecture,
            "layers": list(setup.layer_ids),
            "num_layers": shape.num_layers,
            "budget_bytes": setup.budget_bytes,
            "max_model_len": setup.max_model_len,
            "dtype": shape.dtype,
            "platform": setup.platform,
            "attention_block_size": cfg.cache_config.block_size,
            "block_size_from": (
                f"given ({setup.block_size})"
                if setup.block_size
                else f"vLLM's alignment for {setup.platform} ({ALIGNMENT[setup.platform]})"
            ),
            "ssm_state_dtype": str(cfg.cache_config.mamba_ssm_cache_dtype),
            "host_cpu": cpu_isa(),
            "prefix_caching": setup.prefix_caching,
            "mamba_cache_mode": cfg.cache_config.mamba_cache_mode,
            "kv_cache_layout": cfg.cache_config.kv_cache_layout,
            "hidden_state_bytes_per_token": token_bytes,
        }
    with engine_config(shape, setup, extraction=False) as cfg:
        none = approach(
            cfg, layer_specs(cfg, shape, setup.platform), setup.budget_bytes, token_bytes, ours=False
        )
    none.hidden_state_bytes_needed_per_block = 0
    # the design leaves a model without a full-attention group to vLLM's grouping
    info["ours_is"] = "supplementary tensor" if ours.supplementary else "vLLM's own grouping"
    info["ours_over_vllm"] = (
        round(ours.token_capacity / vllm.token_capacity, 3) if vllm.token_capacity else None
    )
    return {"ours": ours.to_json(), "vllm": vllm.to_json(), "no_extraction": none.to_json(), "setup": info}
