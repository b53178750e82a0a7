"""CacheOnlySpec: the cache-only layer as a supplementary tensor outside vLLM's KV cache groups.

The cache-only layer of ``extract_hidden_states`` (``HiddenStateCacheSpec``) is taken out of
the specs before vLLM groups them, so the KV cache coordinator never sees it. It is
re-blocked to the full-attention group's block size and addressed with that group's block
table and slot mapping. Its tensor holds ``num_blocks`` pages, and the budget pays one page of
it per block: ``num_blocks = budget // (bytes per block of the groups + supplementary pages)``.

It applies where vLLM splits layers into several groups: state layers beside attention
(Qwen3-Next), or sliding-window beside full attention (gpt-oss). There vLLM would give the
cache-only layer a group of its own, its page padded to the common page. A model with no
full-attention layer has no block table to lend. It keeps vLLM's grouping in auto mode
(``fallback``), or is refused when the design is forced on.
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
    UniformTypeKVCacheSpecs,
    is_full_attention_spec,
    replace_as,
)

from hybrid import versions
from hybrid.notice import OncePerProcess
from hybrid.shapes import exact_num_blocks
from kv_connector.common.errors import ConfigurationError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

log = logging.getLogger("vllm.hybrid.spec")

GetKVCacheConfigs = Callable[..., list[KVCacheConfig]]
GetGlobalKVCacheGroups = Callable[["VllmConfig", list[dict[str, KVCacheSpec]]], list["KVCacheGroupSpec"]]


@dataclass(frozen=True, kw_only=True)
class CacheOnlySpec(HiddenStateCacheSpec):
    """The cache-only layer as a supplementary tensor ``[num_blocks, layers, block_size, hidden]``.

    ``block_size`` is the full-attention group's, never padded to another group's page.
    """

    @classmethod
    def of(cls, spec: HiddenStateCacheSpec, block_size: int | None = None) -> CacheOnlySpec:
        return replace_as(
            spec,
            cls,
            block_size=spec.block_size if block_size is None else block_size,
            page_size_padded=None,
        )


class NoAttentionGroupError(ConfigurationError):
    """The model has no full-attention KV cache group to lend its block table."""


@dataclass
class SupplementedKVCacheConfig(KVCacheConfig):
    """vLLM's ``KVCacheConfig`` plus the supplementary tensors of its worker.

    ``supplementary_specs`` maps each layer name to a tensor of ``num_blocks`` pages outside every
    group; ``supplementary_group`` is the group whose block table and slot mapping address them.
    """

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


def needs_own_group(specs: Mapping[str, KVCacheSpec]) -> bool:
    """Whether the design applies: vLLM would give the cache-only layer a KV cache group of its own.

    That happens when the specs mix state layers with attention (Qwen3-Next) or layers of
    several types (sliding-window beside full attention, gpt-oss). A dense model of one attention
    type (Llama, Qwen3) keeps vLLM's handling: the cache-only layer joins its one group, nothing
    padded. A model whose every layer slides keeps it too. vLLM gives its cache-only layer a
    padded group, which the connector ships by its pitch, and no full-attention table is there.
    """
    if any(isinstance(s, MambaSpec) for s in specs.values()):
        return True
    return bool(specs) and UniformTypeKVCacheSpecs.from_specs(dict(specs)) is None


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
        f"block table, and this model has none (groups: {kinds}); {NO_ATTENTION_FIX}"
    )


NO_ATTENTION_FIX = "leave HIDDEN_STATES_SUPPLEMENTARY unset (auto) or set it to 0 to use vLLM's own grouping"


# the line saying vLLM's own grouping applies
FALLBACK_LOGGED = OncePerProcess()


def _no_attention_layer(regular: Mapping[str, KVCacheSpec], fallback: bool) -> bool:
    """Whether these specs lack a full-attention layer, so vLLM's grouping has no full-attention group.

    That raises ``NoAttentionGroupError`` unless ``fallback``, which logs once per process why
    vLLM's own grouping applies.
    """
    if any(is_full_attention_spec(s) for s in regular.values()):
        return False
    kinds = sorted({type(s).__name__ for s in regular.values()})
    why = (
        "the supplementary hidden-state tensor needs a full-attention KV cache group to share its "
        f"block table, and this model has none (layers: {kinds})"
    )
    if not fallback:
        raise NoAttentionGroupError(f"{why}; {NO_ATTENTION_FIX}")
    if FALLBACK_LOGGED.first():
        log.info(
            "hybrid supplementary tensors: not used for this model, vLLM's own grouping applies (the "
            "hidden-state layer gets a KV cache group of its own, its page padded to the common page; "
            "see python -m hybrid.report): %s",
            why,
        )
    return True


def supplemented(
    kv_cache_specs: Sequence[Mapping[str, KVCacheSpec]], fallback: bool = True
) -> list[tuple[dict[str, KVCacheSpec], dict[str, CacheOnlySpec]]] | None:
    """Each worker's (regular, supplementary) specs when the design applies, else None for vLLM's handling.

    It applies to a model that ``needs_own_group`` with a cache-only layer and a full-attention
    layer. A model without a full-attention layer gets None with ``fallback`` (auto mode, one log
    line says why), else ``NoAttentionGroupError``.
    """
    split = [split_supplementary_specs(specs) for specs in kv_cache_specs]
    merged_regular: dict[str, KVCacheSpec] = {}
    for regular, _ in split:
        merged_regular.update(regular)
    if not any(supp for _, supp in split) or not needs_own_group(merged_regular):
        return None
    if _no_attention_layer(merged_regular, fallback):
        return None
    return split


def plan_kv_cache_groups(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    get_global_kv_cache_groups: GetGlobalKVCacheGroups,
    fallback: bool = True,
) -> list[KVCacheGroupSpec]:
    """vLLM 0.33's ``get_global_kv_cache_groups`` (the engine core groups before it
    sizes) with the cache-only layers left out: they join no group."""
    split = supplemented(kv_cache_specs, fallback)
    if split is None:
        return get_global_kv_cache_groups(vllm_config, kv_cache_specs)
    return get_global_kv_cache_groups(vllm_config, [regular for regular, _ in split])


def plan_kv_cache_configs(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
    get_kv_cache_configs: GetKVCacheConfigs | None = None,
    global_kv_cache_groups: list[KVCacheGroupSpec] | None = None,
    fallback: bool = True,
) -> list[KVCacheConfig]:
    """``get_kv_cache_configs`` with the cache-only layers as supplementary tensors.

    Models without a cache-only layer, and dense models of one attention type, go to vLLM
    unchanged. So does a model with no full-attention layer under ``fallback``; without it, that
    model raises ``NoAttentionGroupError``. Otherwise the cache-only layers are split out, and
    vLLM groups and sizes the rest. Each worker's memory is reduced to exactly what its
    supplementary blocks cost, and its config comes back as a ``SupplementedKVCacheConfig``.

    ``get_kv_cache_configs``: the function to call, vLLM's when None, with the installed release's
    arguments (``hybrid.versions``). ``global_kv_cache_groups``: vLLM 0.33's groups as its engine
    core passes them, used when they leave the cache-only layers out and regrouped when not.
    """
    split = supplemented(kv_cache_specs, fallback)
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
