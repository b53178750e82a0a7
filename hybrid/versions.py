"""The vLLM releases the plugin is written for, and the planning functions whose home
differs between them: one code base for both, no copy per version.

vLLM 0.32.0 groups and sizes the KV cache in ``vllm/v1/core/kv_cache_utils.py``
(``get_kv_cache_groups``, ``_pool_bytes_per_block``, ``get_kv_cache_configs(vllm_config,
specs, memory)``, which groups inside). vLLM 0.33.0 moved them to
``vllm/v1/core/kv_cache_planning.py``: the engine core groups first
(``get_global_kv_cache_groups(vllm_config, specs)``) and hands the groups to
``get_kv_cache_configs(vllm_config, specs, memory, global_kv_cache_groups)``, which
divides the memory by the bytes of a block as the platform's ``KVCacheConfigBuilder``
places it (``_pool_bytes_per_block_from_builder``). Which of the two a vLLM has is read
off its planning module, not off its version string.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

SUPPORTED_VLLM = ("0.32.0", "0.33.0")

GetKVCacheConfigs = Callable[..., list["KVCacheConfig"]]


def release(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0``."""
    return version.split("+")[0]


def is_supported(version: str) -> bool:
    return release(version) in SUPPORTED_VLLM


def supported_text(conjunction: str = "and") -> str:
    """``0.32.0 and 0.33.0``."""
    return f" {conjunction} ".join(SUPPORTED_VLLM)


def planning() -> ModuleType:
    """vLLM's module that groups and sizes the KV cache: ``kv_cache_planning`` (0.33),
    else ``kv_cache_utils`` (0.32)."""
    try:
        return importlib.import_module("vllm.v1.core.kv_cache_planning")
    except ModuleNotFoundError:
        return importlib.import_module("vllm.v1.core.kv_cache_utils")


def groups_before_configs() -> bool:
    """Whether the engine core groups the layers before ``get_kv_cache_configs`` and
    passes the groups to it (0.33), rather than ``get_kv_cache_configs`` grouping (0.32)."""
    return hasattr(planning(), "get_global_kv_cache_groups")


def kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_specs: Sequence[Mapping[str, KVCacheSpec]]
) -> list[KVCacheGroupSpec]:
    """vLLM's grouping of the whole model (every worker's specs merged), the way its
    engine core groups it. The callers' dicts are not changed."""
    p = planning()
    specs = [dict(s) for s in kv_cache_specs]
    if hasattr(p, "get_global_kv_cache_groups"):
        groups: list[KVCacheGroupSpec] = p.get_global_kv_cache_groups(vllm_config, specs)
        return groups
    merged: dict[str, KVCacheSpec] = {}
    for one in specs:
        merged.update(one)
    groups = p.get_kv_cache_groups(vllm_config, merged)
    return groups


def pool_bytes_per_block(vllm_config: VllmConfig, groups: list[KVCacheGroupSpec]) -> int:
    """What one block of these groups costs in the worker's pool: the divisor vLLM's
    ``get_kv_cache_configs`` turns memory into blocks with."""
    p = planning()
    if hasattr(p, "_pool_bytes_per_block_from_builder"):
        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

        builder = get_kv_cache_config_builder(vllm_config)
        return int(p._pool_bytes_per_block_from_builder(builder, vllm_config, groups))
    return int(p._pool_bytes_per_block(vllm_config, groups))


def kv_cache_configs(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
    global_kv_cache_groups: list[KVCacheGroupSpec] | None = None,
    get_kv_cache_configs: GetKVCacheConfigs | None = None,
) -> list[KVCacheConfig]:
    """vLLM's ``get_kv_cache_configs`` (or ``get_kv_cache_configs``, the function a
    wrapper wraps) called the way this vLLM calls it: with the groups (computed here
    when not given) on 0.33, without on 0.32."""
    fn: Any = get_kv_cache_configs or planning().get_kv_cache_configs
    if not groups_before_configs():
        out: list[KVCacheConfig] = fn(vllm_config, kv_cache_specs, available_memory)
        return out
    if global_kv_cache_groups is None:
        global_kv_cache_groups = kv_cache_groups(vllm_config, kv_cache_specs)
    out = fn(vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups)
    return out
