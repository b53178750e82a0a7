"""CacheOnlySpec, the split of supplementary specs before vLLM groups the layers, and the
KV cache configs that give each supplementary layer a tensor of its own.

The cache-only layer of ``extract_hidden_states`` (spec ``HiddenStateCacheSpec``) is taken
out of the specs before vLLM's grouping, so it joins no KV cache group and the KV cache
coordinator never sees it. It is re-blocked to the block size of the model's
full-attention group and addressed with that group's block table and slot mapping; its
tensor holds ``num_blocks`` pages, and the budget pays for one page of it per block:
``num_blocks = budget // (bytes per block of the groups + sum of supplementary pages)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    is_full_attention_spec,
    replace_as,
)

from hybrid import versions
from hybrid.shapes import exact_num_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

log = logging.getLogger("vllm.hybrid.spec")

GetKVCacheConfigs = Callable[..., list[KVCacheConfig]]
GetGlobalKVCacheGroups = Callable[["VllmConfig", list[dict[str, KVCacheSpec]]], list["KVCacheGroupSpec"]]


@dataclass(frozen=True, kw_only=True)
class CacheOnlySpec(HiddenStateCacheSpec):
    """The cache-only layer as a supplementary tensor: ``[num_blocks, num_kv_heads
    (captured layers), block_size, head_size (hidden)]``, ``block_size`` being the
    full-attention group's, never padded to another group's page."""

    @classmethod
    def of(cls, spec: HiddenStateCacheSpec, block_size: int | None = None) -> CacheOnlySpec:
        return replace_as(
            spec,
            cls,
            block_size=spec.block_size if block_size is None else block_size,
            page_size_padded=None,
        )


class NoAttentionGroupError(ValueError):
    """The model has no full-attention KV cache group to lend its block table."""


@dataclass
class SupplementedKVCacheConfig(KVCacheConfig):
    """vLLM's ``KVCacheConfig`` plus the supplementary tensors of its worker:
    ``supplementary_specs`` (layer name -> spec, each a tensor of ``num_blocks`` pages
    outside every group) and ``supplementary_group`` (the group whose block table and
    slot mapping address them)."""

    supplementary_specs: dict[str, CacheOnlySpec] = field(default_factory=dict)
    supplementary_group: int | None = None

    @property
    def supplementary_bytes_per_block(self) -> int:
        return sum(s.page_size_bytes for s in self.supplementary_specs.values())

    @classmethod
    def extend(
        cls, config: KVCacheConfig, specs: dict[str, CacheOnlySpec], group: int
    ) -> SupplementedKVCacheConfig:
        base = {f.name: getattr(config, f.name) for f in fields(KVCacheConfig) if f.init}
        return cls(**base, supplementary_specs=specs, supplementary_group=group)


def split_supplementary_specs(
    specs: Mapping[str, KVCacheSpec],
) -> tuple[dict[str, KVCacheSpec], dict[str, CacheOnlySpec]]:
    """(regular, supplementary): every cache-only (hidden-state) layer goes to the
    second dict as a ``CacheOnlySpec``, everything else stays, order kept."""
    regular: dict[str, KVCacheSpec] = {}
    supplementary: dict[str, CacheOnlySpec] = {}
    for name, spec in specs.items():
        if isinstance(spec, HiddenStateCacheSpec):
            supplementary[name] = spec if isinstance(spec, CacheOnlySpec) else CacheOnlySpec.of(spec)
        else:
            regular[name] = spec
    return regular, supplementary


def is_hybrid(specs: Mapping[str, KVCacheSpec]) -> bool:
    """Whether these (regular) specs mix state layers with attention: the models the
    supplementary design is for. Dense models keep vLLM's own handling."""
    return any(isinstance(s, MambaSpec) for s in specs.values())


def attention_group_index(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Index of the first full-attention group (its block table covers every token);
    never assumed to be 0: on Qwen3-Next the three linear-attention groups come first."""
    for i, group in enumerate(groups):
        if is_full_attention_spec(group.kv_cache_spec) and not isinstance(
            group.kv_cache_spec, HiddenStateCacheSpec
        ):
            return i
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    raise NoAttentionGroupError(
        f"the supplementary hidden-state tensor needs a full-attention KV cache group to share its "
        f"block table, and this model has none (groups: {kinds}); run it with "
        "HIDDEN_STATES_SUPPLEMENTARY=0 to use vLLM's own grouping"
    )


def supplemented(
    kv_cache_specs: Sequence[Mapping[str, KVCacheSpec]],
) -> list[tuple[dict[str, KVCacheSpec], dict[str, CacheOnlySpec]]] | None:
    """Each worker's (regular, supplementary) specs when the design applies (a hybrid
    model with a cache-only layer), else None: vLLM's own handling."""
    split = [split_supplementary_specs(specs) for specs in kv_cache_specs]
    merged_regular: dict[str, KVCacheSpec] = {}
    for regular, _ in split:
        merged_regular.update(regular)
    if not any(supp for _, supp in split) or not is_hybrid(merged_regular):
        return None
    return split


def plan_kv_cache_groups(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    get_global_kv_cache_groups: GetGlobalKVCacheGroups,
) -> list[KVCacheGroupSpec]:
    """vLLM 0.33's ``get_global_kv_cache_groups`` (the engine core groups before it
    sizes) with the cache-only layers left out: they join no group."""
    split = supplemented(kv_cache_specs)
    if split is None:
        return get_global_kv_cache_groups(vllm_config, kv_cache_specs)
    return get_global_kv_cache_groups(vllm_config, [regular for regular, _ in split])


def plan_kv_cache_configs(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
    get_kv_cache_configs: GetKVCacheConfigs | None = None,
    global_kv_cache_groups: list[KVCacheGroupSpec] | None = None,
) -> list[KVCacheConfig]:
    """``get_kv_cache_configs`` with the cache-only layers as supplementary tensors.

    Models without a cache-only layer, and dense models, go to vLLM unchanged. Otherwise
    the cache-only layers are split out, vLLM groups and sizes the rest with each
    worker's memory reduced to exactly what its blocks cost without them, and each
    worker's config comes back as a ``SupplementedKVCacheConfig``.

    ``get_kv_cache_configs``: the function to call (vLLM's, when None), with vLLM's
    arguments of the installed release (``hybrid.versions``); ``global_kv_cache_groups``:
    vLLM 0.33's groups, as its engine core passes them (used when they leave the
    cache-only layers out; regrouped here when they hold them).
    """
    split = supplemented(kv_cache_specs)
    if split is None:
        return versions.kv_cache_configs(
            vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups, get_kv_cache_configs
        )
    regulars = [regular for regular, _ in split]
    supplementary_names = {name for _, supp in split for name in supp}
    groups = global_kv_cache_groups
    if groups is None or any(supplementary_names & set(g.layer_names) for g in groups):
        # grouping depends on the specs only: vLLM groups the regular layers the same way
        groups = versions.kv_cache_groups(vllm_config, regulars)
    att = attention_group_index(groups)
    block_size = groups[att].kv_cache_spec.block_size
    group_bytes = versions.pool_bytes_per_block(vllm_config, groups)
    reblocked = [{n: CacheOnlySpec.of(s, block_size) for n, s in supp.items()} for _, supp in split]
    memory = [
        exact_num_blocks(avail, group_bytes, [s.page_size_bytes for s in supp.values()]) * group_bytes
        for avail, supp in zip(available_memory, reblocked, strict=True)
    ]
    configs = versions.kv_cache_configs(vllm_config, regulars, memory, groups, get_kv_cache_configs)
    out: list[KVCacheConfig] = []
    for cfg, supp in zip(configs, reblocked, strict=True):
        out.append(SupplementedKVCacheConfig.extend(cfg, supp, att))
        for name, spec in supp.items():
            log.info(
                "supplementary tensor for %s: %d blocks x %d bytes (%d tokens of %d layers x %d), "
                "addressed by KV cache group %d; %d bytes per block in all",
                name,
                cfg.num_blocks,
                spec.page_size_bytes,
                block_size,
                spec.num_kv_heads,
                spec.head_size,
                att,
                group_bytes + spec.page_size_bytes,
            )
    return out
