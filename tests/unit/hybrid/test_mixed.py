"""Models that are not the usual hybrid, on vLLM's own planning functions: gpt-oss
(sliding-window and full attention alternating: the design lends the full-attention
group's block table, where vLLM gives the hidden states 1-token blocks in padded pages)
and state-only models (no full-attention group: vLLM's own grouping, and what it costs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hybrid.shapes import FULL, LINEAR, SLIDING, HybridShape
from tests.unit.hybrid.shapes import QWEN3_NEXT_80B_A3B

pytestmark = pytest.mark.slow

GIB = 1 << 30
SAMPLE = 2048

# openai/gpt-oss-20b's cache shape (its config.json, less MoE and quantization fields)
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "num_hidden_layers": 24,
    "layer_types": [SLIDING, FULL] * 12,
    "sliding_window": 128,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def test_gpt_oss_shape_is_read_from_its_config() -> None:
    shape = HybridShape.from_config(GPT_OSS_20B)
    assert shape.sliding_attention_layers == tuple(range(0, 24, 2))
    assert shape.full_attention_layers == tuple(range(1, 24, 2))
    assert shape.sliding_window == 128 and not shape.linear_attention_layers
    assert shape.hidden_state_token_bytes(4) == 23_040
    with pytest.raises(ValueError, match="sliding_window"):
        HybridShape.from_config({**GPT_OSS_20B, "sliding_window": None})
    with pytest.raises(ValueError, match="linear and sliding"):
        dataclasses.replace(shape, layer_types=(LINEAR, SLIDING, FULL))


def test_only_models_vllm_splits_into_groups_need_the_design() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from hybrid.spec import needs_own_group

    kv: dict[str, Any] = dict(block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    full, sliding = FullAttentionSpec(**kv), SlidingWindowSpec(**kv, sliding_window=128)
    assert not needs_own_group({"a": full, "b": full})
    assert not needs_own_group({"a": sliding, "b": sliding})
    assert needs_own_group({"a": sliding, "b": full})


@pytest.mark.parametrize(
    ("layers", "data"),
    [((2, 12, 24), 17_280), ((2, 12, 21, 24), 23_040)],
    ids=["3-layers-as-measured", "4-layers"],
)
def test_gpt_oss_20b_vllm_pads_one_token_blocks_ours_ships_full_group_blocks(
    layers: tuple[int, ...], data: int
) -> None:
    """The planning case of issue 22: 24 alternating layers, hidden 2880, FlashAttention's
    16-token blocks, a 2048-token sample. vLLM gives the hidden states a group of its own
    whose block is 1 token, each in a page padded to the common 32,768 bytes and holding
    a whole pool block (12 layers' pages) until shipped: 2048 descriptors. The design
    addresses a supplementary tensor with the full-attention group's block table: 16-token
    dense blocks, 128 descriptors at most (one when the blocks are consecutive), the same
    bytes shipped and nothing padded."""
    from hybrid.accounting import Setup, compare

    shape = HybridShape.from_config(GPT_OSS_20B)
    r = compare(
        shape, Setup(layer_ids=layers, budget_bytes=20 * GIB, max_model_len=8192, sample_tokens=SAMPLE)
    )
    ours, vllm = r["ours"], r["vllm"]
    assert r["setup"]["ours_is"] == "supplementary tensor"
    pool_block = 12 * 32_768  # each pool block: one page of each of 12 tensors, shared by the groups
    assert [(g["kind"], g["layers"], g["block_size"], g["page_bytes"]) for g in vllm["groups"]] == [
        ("sliding_window", 12, 16, 32_768),
        ("full_attention", 12, 16, 32_768),
        ("hidden_states", 1, 1, 32_768),
    ]
    assert vllm["shipping"] == {
        "sample_tokens": SAMPLE,
        "block_tokens": 1,
        "block_data_bytes": data,
        "block_pitch_bytes": 32_768,
        "padded": True,
        "blocks": SAMPLE,
        "descriptors_at_most": SAMPLE,
        "bytes_shipped": SAMPLE * data,
        "cache_bytes_held": SAMPLE * pool_block,
    }
    (supp,) = ours["supplementary"]
    assert supp["addressed_by_group"] == 1  # the full-attention group
    assert supp["page_bytes"] == 16 * data
    assert ours["shipping"] == {
        "sample_tokens": SAMPLE,
        "block_tokens": 16,
        "block_data_bytes": 16 * data,
        "block_pitch_bytes": 16 * data,
        "padded": False,
        "blocks": SAMPLE // 16,
        "descriptors_at_most": SAMPLE // 16,
        "bytes_shipped": SAMPLE * data,
        "cache_bytes_held": SAMPLE * data,
    }
    assert ours["bytes_per_block"] == pool_block + 16 * data  # every byte counted once
    assert ours["token_capacity"] > 6 * vllm["token_capacity"]


def test_a_linear_attention_only_model_keeps_vllms_grouping_and_its_cost() -> None:
    """Qwen3-Next-80B's shape with every layer linear attention: no full-attention
    group, so the design stands aside; the report shows vLLM's figures for both, the
    hidden-state block's padding and pool blocks included."""
    from hybrid.accounting import Setup, compare

    shape = HybridShape.from_config({**QWEN3_NEXT_80B_A3B, "layer_types": [LINEAR] * 48})
    r = compare(
        shape,
        Setup(
            layer_ids=(2, 24, 45, 47),
            budget_bytes=20 * GIB,
            max_model_len=8192,  # 32768 does not fit 20 GiB this way
            prefix_caching=False,
            sample_tokens=SAMPLE,
        ),
    )
    ours, vllm = r["ours"], r["vllm"]
    assert r["setup"]["ours_is"] == "vLLM's own grouping"
    assert ours == vllm and ours["refused"] is None
    ship = vllm["shipping"]
    assert vllm["groups"][-1]["kind"] == "hidden_states"
    assert ship["block_tokens"] == vllm["groups"][-1]["block_size"]
    assert ship["block_data_bytes"] == ship["block_tokens"] * 4 * 2048 * 2
    assert ship["blocks"] == -(-SAMPLE // ship["block_tokens"])
    assert ship["bytes_shipped"] == SAMPLE * 4 * 2048 * 2
    assert ship["cache_bytes_held"] == ship["blocks"] * ours["bytes_per_block"]
