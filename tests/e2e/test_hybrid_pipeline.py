"""Real vLLM (CPU build) on a tiny hybrid Qwen3-Next, with the hybrid plugin loaded
through a ``vllm.general_plugins`` entry point -> HiddenStatesConnector -> NIXL ->
HiddenStatesReader.

The plugin must be active in the producer (its log lines, and as many blocks as
``hybrid.accounting`` predicts for the budget), and every received sample must hold the
transformers model's hidden states for its tokens, within bf16 tolerance, non-zero,
exactly once: prompts shorter than, equal to and longer than the attention block, in one
mixed batch with chunked prefill. The block is not a constant: vLLM's CPU platform aligns
it to the SSM state, which is float32 on a CPU with AVX-512 BF16 and bf16 otherwise (384
or 256 tokens here); the tests derive it with vLLM's own functions (``hybrid.accounting``)
and by hand, check that the engine chose it, and run once with the platform's state dtype
and once with the other one, so both block sizes are exercised on every CPU. Prefix
caching stays off: vLLM's CPU build cannot run hybrid models with it (its mamba "align"
mode launches a Triton kernel), with or without this design.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hybrid.host import cpu_ssm_state_is_float32
from kv_connector.reader import HiddenStatesReader, Sample
from tests.e2e.conftest import Reference, check_samples, prompts_of, run_and_collect
from tests.engines import EngineSpec, Run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYER_IDS = [1, 4, 8]  # 8 = the last layer's output, before the final norm
HIDDEN = 128
BUDGET = 64 << 20
MAX_LEN = 2048
# the SSM state dtype the platform picks on this CPU, and the other one a user may pin
PLATFORM_STATE = "float32" if cpu_ssm_state_is_float32() else "bfloat16"
OTHER_STATE = "bfloat16" if PLATFORM_STATE == "float32" else "float32"


def hand_block(state_dtype: str) -> int:
    """The tiny model's attention block on the CPU platform, by hand: its GDN state is
    conv (kernel 4 - 1 + 1 speculative) x conv_dim (128 * 1 * 2 + 128 * 2 = 512) bf16
    plus recurrent 2 heads x 128 x 128 in the state dtype; an attention token is K and V
    x 2 kv heads x head dim 64 x bf16 = 512 bytes; blocks start from 128 tokens."""
    state = 4 * 512 * 2 + 2 * 128 * 128 * (4 if state_dtype == "float32" else 2)
    return 128 * -(-state // (128 * 512))


def predicted(model: Path, state_dtype: str) -> tuple[int, int]:
    """(attention block, number of blocks) that hybrid.accounting computes with vLLM's
    own functions for this model, budget and SSM state dtype on this host's CPU platform."""
    from hybrid.accounting import Setup, engine_config, layer_specs
    from hybrid.shapes import HybridShape
    from hybrid.spec import plan_kv_cache_configs

    shape = HybridShape.from_config(json.loads((model / "config.json").read_text()))
    shape = dataclasses.replace(shape, mamba_ssm_dtype=state_dtype)
    setup = Setup(
        layer_ids=tuple(LAYER_IDS),
        budget_bytes=BUDGET,
        max_model_len=MAX_LEN,
        platform="cpu",
        prefix_caching=False,
    )
    with engine_config(shape, setup) as cfg:
        (config,) = plan_kv_cache_configs(cfg, [layer_specs(cfg, shape, "cpu")], [BUDGET])
        return int(cfg.cache_config.block_size), int(config.num_blocks)


def check_plugin_was_active(log: str, model: Path, state_dtype: str) -> int:
    """The plugin's lines in the producer's log match the prediction; returns the block."""
    block, num_blocks = predicted(model, state_dtype)
    assert block == hand_block(state_dtype), (block, state_dtype)
    assert "hybrid supplementary tensors active" in log
    m = re.search(
        r"supplementary tensor for (\S+): (\d+) blocks x (\d+) bytes "
        r"\((\d+) tokens of (\d+) layers x (\d+)\), addressed by KV cache group (\d+)",
        log,
    )
    assert m, log[-3000:]
    name, blocks, page, tokens, layers, hidden, group = m.groups()
    assert name == "cache_only_layers.8" and int(group) == 3
    assert (int(tokens), int(layers), int(hidden)) == (block, len(LAYER_IDS), HIDDEN)
    assert int(page) == block * len(LAYER_IDS) * HIDDEN * 2
    assert int(blocks) == num_blocks
    assert f"supplementary hidden-state tensor cache_only_layers.8: shape ({blocks}, 3, {block}, 128)" in log
    return block


def check_hybrid_samples(
    got: dict[str, Sample],
    result: dict[str, Any],
    prompts: list[list[int]],
    ref: Reference,
    with_output: set[int],
) -> float:
    """bf16 through 8 layers: ~0.02 relative error measured, every token within 0.4."""
    return check_samples(
        got,
        result,
        prompts,
        ref,
        LAYER_IDS,
        with_output,
        dtype=torch.bfloat16,
        tolerance=0.05,
        token_tolerance=0.4,
    )


@pytest.mark.fresh_engine("the hybrid model, an engine per SSM state dtype")
@pytest.mark.parametrize("state_dtype", [PLATFORM_STATE, OTHER_STATE])
def test_inprocess_chunked_prefill_across_attention_blocks(
    tiny_qwen3_next: Path,
    qwen3_next_reference: Reference,
    hybrid_plugin_env: dict[str, str],
    state_dtype: str,
) -> None:
    block = hand_block(state_dtype)
    lengths = [1, block - 1, block, block + 1, 600, 37, 1000, 5]
    prompts = prompts_of(lengths, seed=21)
    with HiddenStatesReader() as reader:
        spec = EngineSpec.of(
            tiny_qwen3_next, LAYER_IDS, dtype="bfloat16", block_size=None, max_model_len=MAX_LEN,
            kv_cache_memory_bytes=BUDGET, max_num_batched_tokens=block,  # 600 and 1000 take several steps
            mamba_ssm_cache_dtype=state_dtype,
        )  # fmt: skip
        run = Run(prompts, max_tokens=[1, 2, 1, 3, 1, 4, 2, 1])
        got, result, log = run_and_collect(reader, spec, run, len(prompts), env=hybrid_plugin_env)
    assert check_plugin_was_active(log, tiny_qwen3_next, state_dtype) == block
    worst = check_hybrid_samples(got, result, prompts, qwen3_next_reference, with_output=set())
    print(f"block {block} ({state_dtype} state): worst relative error {worst:.3e}")


@pytest.mark.fresh_engine("the hybrid model in vLLM's multi-process engine")
def test_multiprocess_engine_with_output_tokens(
    tiny_qwen3_next: Path, qwen3_next_reference: Reference, hybrid_plugin_env: dict[str, str]
) -> None:
    block = hand_block(PLATFORM_STATE)  # the platform's own choice: nothing pinned
    lengths = [3, block, 300, block + 1]
    prompts = prompts_of(lengths, seed=22)
    with HiddenStatesReader() as reader:
        spec = EngineSpec.of(
            tiny_qwen3_next, LAYER_IDS, dtype="bfloat16", block_size=None, max_model_len=MAX_LEN,
            kv_cache_memory_bytes=BUDGET, inprocess=False,
        )  # fmt: skip
        # 2 and 3 shipped at finish: prompt + outputs, across a block boundary
        run = Run(prompts, max_tokens=[2, 1, 4, 6], with_output=[2, 3])
        got, result, log = run_and_collect(reader, spec, run, len(prompts), env=hybrid_plugin_env)
    assert check_plugin_was_active(log, tiny_qwen3_next, PLATFORM_STATE) == block
    check_hybrid_samples(got, result, prompts, qwen3_next_reference, with_output={2, 3})
