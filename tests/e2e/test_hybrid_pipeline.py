"""Real vLLM (CPU build) on a tiny hybrid Qwen3-Next, with the hybrid plugin loaded
through a ``vllm.general_plugins`` entry point -> HiddenStatesConnector -> NIXL ->
HiddenStatesReader.

The plugin must be active in the producer (its log lines, and as many blocks as
``hybrid.accounting`` predicts for the budget), and every received sample must hold the
transformers model's hidden states for its tokens, within bf16 tolerance, non-zero,
exactly once: prompts shorter than, equal to and longer than the attention block (256
tokens on CPU), in one mixed batch with chunked prefill. Prefix caching stays off:
vLLM's CPU build cannot run hybrid models with it (its mamba "align" mode launches a
Triton kernel), with or without this design.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kv_connector.reader import HiddenStatesReader, Sample
from tests.e2e.conftest import Reference, prompts_of, relative_error, run_and_collect

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYER_IDS = [1, 4, 8]  # 8 = the last layer's output, before the final norm
HIDDEN = 128
BLOCK = 256  # attention block vLLM's CPU platform picks for this model
BUDGET = 64 << 20
MAX_LEN = 2048


def predicted_num_blocks(model: Path) -> int:
    """What hybrid.accounting computes for this model and budget on the CPU platform."""
    from hybrid.accounting import Setup, engine_config, layer_specs
    from hybrid.shapes import HybridShape
    from hybrid.spec import plan_kv_cache_configs

    shape = HybridShape.from_config(json.loads((model / "config.json").read_text()))
    setup = Setup(
        layer_ids=tuple(LAYER_IDS),
        budget_bytes=BUDGET,
        max_model_len=MAX_LEN,
        platform="cpu",
        prefix_caching=False,
    )
    with engine_config(shape, setup) as cfg:
        (config,) = plan_kv_cache_configs(cfg, [layer_specs(cfg, shape, "cpu")], [BUDGET])
    return int(config.num_blocks)


def check_plugin_was_active(log: str, model: Path) -> None:
    assert "hybrid supplementary tensors active" in log
    m = re.search(
        r"supplementary tensor for (\S+): (\d+) blocks x (\d+) bytes "
        r"\((\d+) tokens of (\d+) layers x (\d+)\), addressed by KV cache group (\d+)",
        log,
    )
    assert m, log[-3000:]
    name, blocks, page, tokens, layers, hidden, group = m.groups()
    assert name == "cache_only_layers.8" and int(group) == 3
    assert (int(tokens), int(layers), int(hidden)) == (BLOCK, len(LAYER_IDS), HIDDEN)
    assert int(page) == BLOCK * len(LAYER_IDS) * HIDDEN * 2
    assert int(blocks) == predicted_num_blocks(model)
    assert f"supplementary hidden-state tensor cache_only_layers.8: shape ({blocks}, 3, {BLOCK}, 128)" in log


def check_samples(
    got: dict[str, Sample],
    result: dict[str, Any],
    prompts: list[list[int]],
    ref: Reference,
    with_output: set[int],
) -> float:
    worst = 0.0
    assert {o["request_id"] for o in result["outputs"]} == set(got)
    for i, (o, prompt) in enumerate(zip(result["outputs"], prompts, strict=True)):
        s = got[o["request_id"]]
        tokens = prompt + o["output_token_ids"][:-1] if i in with_output else prompt
        assert s.token_ids.tolist() == tokens
        assert s.layer_ids == tuple(LAYER_IDS)
        assert s.hidden_states.shape == (len(tokens), len(LAYER_IDS), HIDDEN)
        assert s.hidden_states.dtype == torch.bfloat16
        want = ref.states(tokens, LAYER_IDS)
        got_f = s.hidden_states.float()
        # every token's states are there (a zero or foreign row is off by ~1 or more)
        per_token = (got_f - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2))
        assert bool((got_f.abs().sum(dim=(1, 2)) > 0).all()), (i, "all-zero token states")
        assert float(per_token.max()) < 0.4, (i, len(tokens), int(per_token.argmax()), float(per_token.max()))
        err = relative_error(s.hidden_states, want)
        assert err < 0.05, (i, len(tokens), err)  # bf16 through 8 layers: ~0.02 measured
        worst = max(worst, err)
    return worst


def test_inprocess_chunked_prefill_across_attention_blocks(
    tiny_qwen3_next: Path, qwen3_next_reference: Reference, hybrid_plugin_env: dict[str, str]
) -> None:
    lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 600, 37, 1000, 5]
    prompts = prompts_of(lengths, seed=21)
    with HiddenStatesReader() as reader:
        spec = dict(
            model=str(tiny_qwen3_next),
            address=reader.address,
            layer_ids=LAYER_IDS,
            prompts=prompts,
            dtype="bfloat16",
            max_model_len=MAX_LEN,
            kv_cache_memory_bytes=BUDGET,
            max_tokens=[1, 2, 1, 3, 1, 4, 2, 1],
            max_num_batched_tokens=BLOCK,  # 600 and 1000 take several steps
            enable_prefix_caching=False,
            inprocess=True,
        )
        got, result, log = run_and_collect(reader, spec, len(prompts), env=hybrid_plugin_env)
    check_plugin_was_active(log, tiny_qwen3_next)
    worst = check_samples(got, result, prompts, qwen3_next_reference, with_output=set())
    print(f"worst relative error {worst:.3e}")


def test_multiprocess_engine_with_output_tokens(
    tiny_qwen3_next: Path, qwen3_next_reference: Reference, hybrid_plugin_env: dict[str, str]
) -> None:
    lengths = [3, BLOCK, 300, BLOCK + 1]
    prompts = prompts_of(lengths, seed=22)
    with HiddenStatesReader() as reader:
        spec = dict(
            model=str(tiny_qwen3_next),
            address=reader.address,
            layer_ids=LAYER_IDS,
            prompts=prompts,
            dtype="bfloat16",
            max_model_len=MAX_LEN,
            kv_cache_memory_bytes=BUDGET,
            max_tokens=[2, 1, 4, 6],
            with_output=[2, 3],  # shipped at finish: prompt + outputs, block 1 then 2
            enable_prefix_caching=False,
            inprocess=False,
        )
        got, result, log = run_and_collect(reader, spec, len(prompts), env=hybrid_plugin_env)
    check_plugin_was_active(log, tiny_qwen3_next)
    check_samples(got, result, prompts, qwen3_next_reference, with_output={2, 3})
