"""Worker side of the design: supplementary tensors beside vLLM's KV cache, and the drafter's group.

It allocates each supplementary layer's tensor beside vLLM's KV cache, and points the
extract_hidden_states drafter at the attention group. It does so by wrapping vLLM
0.32/0.33 functions, installed by ``hybrid.plugin``.

``allocate_kv_cache`` returns the supplementary views too, so vLLM binds them to their
layers and hands them to the KV connector's ``register_kv_caches``. It is wrapped where
each model runner looks it up: Model Runner V1 in ``gpu_model_runner``, V2 in
``gpu/attn_utils``.

The drafter then writes with the attention group's slot mapping. In V1,
``ExtractHiddenStatesProposer.validate_same_kv_cache_group`` takes the config's
``supplementary_group`` for a layer that is in no group; V1 builds the layer's metadata
from that group. In V2, ``ExtractHiddenStatesSpeculator.propose`` looks the layer up by
name in the step's slot mappings and attention metadata, built per group. It finds the
layer there under that group's slot mapping.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)

from hybrid.notice import announce
from hybrid.spec import SupplementedKVCacheConfig
from kv_connector.common.errors import ConfigurationError

log = logging.getLogger("vllm.hybrid.runtime")

ORIGINAL = "__hybrid_original__"


def allocate_supplementary(
    kv_cache_config: KVCacheConfig,
    device: torch.device,
    layout: Any,
    kernel_block_sizes: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """One zeroed tensor of ``num_blocks`` pages per supplementary layer; {} for a config without any.

    vLLM's own ``create_kv_cache_views`` views each as ``[num_blocks, num_kv_heads,
    block_size, head_size]`` in the resolved KV cache layout."""
    if not isinstance(kv_cache_config, SupplementedKVCacheConfig) or not kv_cache_config.supplementary_specs:
        return {}
    group = kv_cache_config.supplementary_group
    assert group is not None
    block_size = kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
    if (
        kernel_block_sizes is not None
        and group < len(kernel_block_sizes)
        and kernel_block_sizes[group] != block_size
    ):
        raise ConfigurationError(
            f"KV cache group {group} splits its {block_size}-token blocks into "
            f"{kernel_block_sizes[group]}-token kernel blocks; the supplementary hidden-state tensor "
            "follows the group's slot mapping and cannot be addressed by manager block then. Set "
            "HIDDEN_STATES_SUPPLEMENTARY=0, or choose a block size the attention backend runs unsplit."
        )
    num_blocks = kv_cache_config.num_blocks
    out: dict[str, torch.Tensor] = {}
    for name, spec in kv_cache_config.supplementary_specs.items():
        if spec.block_size != block_size:
            raise ConfigurationError(
                f"{name}: supplementary block size {spec.block_size} != group's {block_size}"
            )
        layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, 1, layout)
        tensor = KVCacheTensor(
            size=spec.page_size_bytes * num_blocks,
            layers=[name],
            layer_stride=layer_stride,
            block_stride=block_stride,
        )
        raw = torch.zeros(tensor.size, dtype=torch.int8, device=device)
        (out[name],) = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return out


AllocateKVCache = Callable[..., dict[str, torch.Tensor]]


def with_supplementary_tensors(allocate: AllocateKVCache) -> AllocateKVCache:
    """Wrap vLLM's ``allocate_kv_cache(kv_cache_config, device, layout,
    kernel_block_sizes=None)``: its tensors plus the supplementary ones."""

    @functools.wraps(allocate)
    def allocate_kv_cache(
        kv_cache_config: KVCacheConfig,
        device: torch.device,
        layout: Any,
        kernel_block_sizes: list[int] | None = None,
    ) -> dict[str, torch.Tensor]:
        announce()
        kv_caches = allocate(kv_cache_config, device, layout, kernel_block_sizes)
        extra = allocate_supplementary(kv_cache_config, device, layout, kernel_block_sizes)
        for name, view in extra.items():
            log.info(
                "supplementary hidden-state tensor %s: shape %s %s, %d bytes",
                name,
                tuple(view.shape),
                view.dtype,
                view.untyped_storage().nbytes(),
            )
        kv_caches.update(extra)
        return kv_caches

    setattr(allocate_kv_cache, ORIGINAL, allocate)
    return allocate_kv_cache


def with_supplementary_group(
    validate: Callable[[Any, KVCacheConfig], None],
) -> Callable[[Any, KVCacheConfig], None]:
    """Wrap ``ExtractHiddenStatesProposer.validate_same_kv_cache_group``: a cache-only
    layer that is a supplementary tensor takes the group that addresses it."""

    @functools.wraps(validate)
    def validate_same_kv_cache_group(self: Any, kv_cache_config: KVCacheConfig) -> None:
        if isinstance(kv_cache_config, SupplementedKVCacheConfig) and set(self.attn_layer_names) <= set(
            kv_cache_config.supplementary_specs
        ):
            assert kv_cache_config.supplementary_group is not None
            self.kv_cache_gid = kv_cache_config.supplementary_group
            return
        validate(self, kv_cache_config)

    setattr(validate_same_kv_cache_group, ORIGINAL, validate)
    return validate_same_kv_cache_group


def supplement_draft_inputs(speculator: Any, attn_metadata: Any, slot_mappings: Any) -> list[str]:
    """Model Runner V2: put each supplementary draft layer in the step's dicts. Returns the names added.

    Each layer gets the step's slot mapping of the group that addresses it, and cache-only
    metadata over it: what V1's drafter builds from that group."""
    config = getattr(speculator, "kv_cache_config", None)
    if not isinstance(config, SupplementedKVCacheConfig) or not isinstance(slot_mappings, dict):
        return []
    names = [
        n
        for n in sorted(getattr(speculator, "draft_attn_layer_names", ()))
        if n in config.supplementary_specs and n not in slot_mappings
    ]
    if not names:
        return []
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionMetadata

    assert config.supplementary_group is not None
    group = config.kv_cache_groups[config.supplementary_group]
    slot_mapping = slot_mappings[group.layer_names[0]]
    for name in names:
        slot_mappings[name] = slot_mapping
        if isinstance(attn_metadata, dict):
            attn_metadata[name] = CacheOnlyAttentionMetadata(slot_mapping=slot_mapping)
    return names


def with_supplementary_slots(propose: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap V2's ``ExtractHiddenStatesSpeculator.propose(input_batch, attn_metadata, slot_mappings, ...)``.

    The supplementary layer is then in the step's dicts before the drafter reads them. The
    wrapper takes its arguments by keyword and by position."""


    @functools.wraps(propose)
    def wrapper(
        self: Any, input_batch: Any, attn_metadata: Any, slot_mappings: Any, *args: Any, **kw: Any
    ) -> Any:
        supplement_draft_inputs(self, attn_metadata, slot_mappings)
        return propose(self, input_batch, attn_metadata, slot_mappings, *args, **kw)

    setattr(wrapper, ORIGINAL, propose)
    return wrapper
