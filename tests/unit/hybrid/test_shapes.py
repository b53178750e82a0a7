"""Hybrid-model shapes read from config.json, and the exact-budget block count (pure
logic: no vllm). The published config.json dicts of Qwen3-Next-80B-A3B and Qwen3.5-9B
live here for the tests that run vLLM's functions on them (test_hybrid_accounting)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybrid.shapes import FULL, LINEAR, HybridShape, exact_num_blocks, parse_layer_ids

# Qwen/Qwen3-Next-80B-A3B-Instruct config.json as published on Hugging Face (every field).
QWEN3_NEXT_80B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen/Qwen3.5-9B config.json as published (language model under text_config; the
# vision tower's fields do not touch the KV cache and are abridged).
QWEN3_5_9B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "mtp_num_hidden_layers": 1,
        "num_attention_heads": 16,
        "num_hidden_layers": 32,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "use_cache": True,
        "vocab_size": 248320,
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}
QWEN3_5_9B["text_config"]["layer_types"] = QWEN3_5_9B["text_config"]["layer_types"] * 8


def test_qwen3_next_shape() -> None:
    s = HybridShape.from_config(QWEN3_NEXT_80B_A3B)
    assert s.num_layers == 48
    assert s.full_attention_layers == tuple(range(3, 48, 4))
    assert len(s.linear_attention_layers) == 36
    assert (s.hidden_size, s.num_key_value_heads, s.head_dim, s.dtype) == (2048, 2, 256, "bfloat16")
    assert s.mamba_ssm_dtype is None
    assert s.hidden_state_token_bytes(4) == 4 * 2048 * 2


def test_qwen3_5_shape_reads_the_text_config() -> None:
    s = HybridShape.from_config(QWEN3_5_9B)
    assert s.architecture == "Qwen3_5ForConditionalGeneration"
    assert s.num_layers == 32 and s.full_attention_layers == tuple(range(3, 32, 4))
    assert (s.hidden_size, s.num_key_value_heads, s.head_dim) == (4096, 4, 256)
    assert s.mamba_ssm_dtype == "float32"


def test_layer_types_from_the_interval_equal_the_explicit_list() -> None:
    text = dict(QWEN3_5_9B["text_config"])
    explicit = HybridShape.from_config(text)
    del text["layer_types"]
    assert HybridShape.from_config(text) == explicit


def test_dtype_override() -> None:
    assert HybridShape.from_config(QWEN3_NEXT_80B_A3B, dtype="float16").dtype == "float16"
    with pytest.raises(ValueError, match="unsupported dtype"):
        HybridShape.from_config(QWEN3_NEXT_80B_A3B, dtype="int3")


def test_dense_config_is_refused_by_name() -> None:
    dense = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_hidden_layers": 4}
    dense |= {"num_attention_heads": 4, "max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="hybrid"):
        HybridShape.from_config(dense)


def test_layer_types_must_match_the_layer_count() -> None:
    bad = dict(QWEN3_NEXT_80B_A3B, layer_types=[FULL, LINEAR])
    with pytest.raises(ValueError, match="2 entries for 48 layers"):
        HybridShape.from_config(bad)


def test_standin_config_has_the_same_cache_shape() -> None:
    for published in (QWEN3_NEXT_80B_A3B, QWEN3_5_9B):
        shape = HybridShape.from_config(published)
        back = HybridShape.from_config(shape.standin_config())
        assert back.architecture == "Qwen3NextForCausalLM"
        # the recurrent state's dtype travels as an engine argument, not in the stand-in
        assert back == dataclasses.replace(shape, architecture="Qwen3NextForCausalLM", mamba_ssm_dtype=None)


def test_parse_layer_ids() -> None:
    assert parse_layer_ids("2,24,45,47", 48) == [2, 24, 45, 47]
    assert parse_layer_ids("48", 48) == [48]
    with pytest.raises(ValueError, match=r"outside 0\.\.48"):
        parse_layer_ids("2,49", 48)
    with pytest.raises(ValueError, match="integers"):
        parse_layer_ids("2,x", 48)
    with pytest.raises(ValueError, match="no layer"):
        parse_layer_ids(",", 48)


@given(
    st.integers(0, 1 << 40),
    st.integers(1, 1 << 26),
    st.lists(st.integers(1, 1 << 24), max_size=3),
)
def test_exact_num_blocks_spends_the_budget_and_never_more(
    budget: int, groups: int, pages: list[int]
) -> None:
    n = exact_num_blocks(budget, groups, pages)
    per_block = groups + sum(pages)
    assert n * per_block <= budget < (n + 1) * per_block


def test_exact_num_blocks_rejects_empty_pages() -> None:
    with pytest.raises(ValueError):
        exact_num_blocks(1 << 30, 0, [])
    with pytest.raises(ValueError):
        exact_num_blocks(1 << 30, 4096, [0])
