"""Hybrid-model shapes read from config.json, and the exact-budget block count (pure
logic: no vllm). The published config.json dicts of Qwen3-Next-80B-A3B and Qwen3.5-9B
live in ``tests.unit.hybrid.shapes``, shared with the tests that run vLLM's functions on
them (test_accounting, test_mixed)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybrid.shapes import FULL, LINEAR, HybridShape, exact_num_blocks, parse_layer_ids
from tests.unit.hybrid.shapes import QWEN3_5_9B, QWEN3_NEXT_80B_A3B


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
