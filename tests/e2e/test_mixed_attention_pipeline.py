"""Real vLLM (CPU build) on models whose layers vLLM splits into several KV cache groups
without a hybrid's usual shape -> HiddenStatesConnector -> NIXL -> HiddenStatesReader,
every sample against transformers:

- a tiny gpt-oss (sliding-window and full attention alternating, a 32-token window,
  shorter than most prompts), fp32 and bf16: the cache-only layer becomes a
  supplementary tensor addressed by the full-attention group (blocks of that group's
  size, dense); and with the design off, vLLM's own group for it, its blocks padded to
  the common page, shipped without the padding;
- a tiny Qwen3-Next whose layers are all linear attention (no full-attention group to
  lend a block table): auto mode hands it to vLLM's own grouping, says so once, and it
  ships exactly.

Before these changes every one of them was refused at start-up ("blocks are not dense",
``NoAttentionGroupError``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kv_connector.reader import HiddenStatesReader
from tests.e2e.conftest import Reference, check_samples, prompts_of, run_and_collect
from tests.engines import EngineSpec, Run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HIDDEN = 128
BUDGET = 64 << 20
MAX_LEN = 2048
GPT_OSS_LAYERS = [1, 3, 4]  # 4 = the last layer's output, before the final norm
WINDOW = 32
# shorter than, equal to and longer than the window and a 128-token block; chunked below
GPT_OSS_LENGTHS = [1, 5, WINDOW - 1, WINDOW, WINDOW + 1, 127, 128, 129, 300, 700]


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from scripts.support.make_tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {
        dtype: build_tiny_model(root / f"tiny-gpt-oss-{dtype}", "gpt_oss", seed=0, dtype=dtype)
        for dtype in ("float32", "bfloat16")
    }


def gpt_oss_spec(model: Path, dtype: str) -> tuple[EngineSpec, Run]:
    """gpt-oss's engine and its run: prompts across the sliding window's edge, two of them
    shipped with their outputs (3 and 8); 256 tokens a step (300 and 700 take several)."""
    spec = EngineSpec.of(
        model, GPT_OSS_LAYERS, dtype=dtype, block_size=None, max_model_len=MAX_LEN,
        kv_cache_memory_bytes=BUDGET, max_num_batched_tokens=256,
    )  # fmt: skip
    max_tokens = [1, 2, 1, 3, 1, 1, 2, 1, 1, 2]
    run = Run(prompts_of(GPT_OSS_LENGTHS, seed=31), max_tokens=max_tokens, with_output=[3, 8])
    return spec, run


# (per sample, per token) relative error. fp32: 4e-7 measured. bf16: ~7e-3 per token,
# except where a token's expert choice flips between bf16 vLLM and the fp32 reference
# (one token of 300 measured at 0.47, the sample at 0.06); a zero or foreign row is off
# by ~1 or more.
TOLERANCE = {"float32": (1e-4, 1e-3), "bfloat16": (0.1, 0.8)}


@pytest.mark.fresh_engine("gpt-oss, an engine per dtype")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt_oss_ships_through_the_full_attention_group(
    tiny_gpt_oss: dict[str, Path], hybrid_plugin_env: dict[str, str], dtype: str
) -> None:
    model = tiny_gpt_oss[dtype]
    env = {**hybrid_plugin_env, "HIDDEN_STATES_SUPPLEMENTARY": "auto"}
    with HiddenStatesReader() as reader:
        spec, run = gpt_oss_spec(model, dtype)
        prompts = [list(p) for p in run.prompts]
        got, result, log = run_and_collect(reader, spec, run, len(prompts), env=env)
    m = re.search(
        r"supplementary tensor for cache_only_layers\.4: (\d+) blocks x (\d+) bytes "
        r"\((\d+) tokens of 3 layers x 128\), addressed by KV cache group (\d+)",
        log,
    )
    assert m, log[-3000:]
    _, page, tokens, group = map(int, m.groups())
    assert group == 1  # gpt-oss: group 0 slides, group 1 attends to everything
    assert page == tokens * 3 * HIDDEN * (4 if dtype == "float32" else 2)  # no padding
    assert "blocks are not dense" not in log and "descriptor of its own" not in log
    tol, token_tol = TOLERANCE[dtype]
    worst = check_samples(
        got,
        result,
        prompts,
        Reference(model),
        GPT_OSS_LAYERS,
        with_output={3, 8},
        dtype=getattr(torch, dtype),
        tolerance=tol,
        token_tolerance=token_tol,
    )
    print(f"gpt-oss {dtype}, block {tokens}: worst relative error {worst:.3e}")


@pytest.mark.fresh_engine("the supplementary-tensor design off")
def test_gpt_oss_ships_from_vllms_padded_group_with_the_design_off(
    tiny_gpt_oss: dict[str, Path], hybrid_plugin_env: dict[str, str]
) -> None:
    """HIDDEN_STATES_SUPPLEMENTARY=0 (and any vLLM the plugin does not patch): vLLM's own
    group for the hidden states, each block in a page padded to the common page."""
    model = tiny_gpt_oss["float32"]
    env = {**hybrid_plugin_env, "HIDDEN_STATES_SUPPLEMENTARY": "0"}
    with HiddenStatesReader() as reader:
        spec, run = gpt_oss_spec(model, "float32")
        prompts = [list(p) for p in run.prompts]
        got, result, log = run_and_collect(reader, spec, run, len(prompts), env=env)
    m = re.search(r"page alignment wastes (\d+) bytes", log)
    assert m and int(m.group(1)) > 0, log[-3000:]
    assert "supplementary tensor for" not in log
    assert re.search(r"lie \d+ bytes apart .* each block is one descriptor of its own", log), log[-3000:]
    check_samples(
        got,
        result,
        prompts,
        Reference(model),
        GPT_OSS_LAYERS,
        with_output={3, 8},
        tolerance=1e-4,
        token_tolerance=1e-3,
    )


LINEAR_LAYERS = [1, 2, 4]


@pytest.fixture(scope="module")
def tiny_linear_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scripts.support.make_tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny-qwen3-next-linear"
    return build_tiny_model(out, "qwen3_next_linear", seed=0, dtype="bfloat16")


@pytest.mark.fresh_engine("a linear-attention-only model, an engine per layer set")
@pytest.mark.parametrize("layer_ids", [LINEAR_LAYERS, [1, 4]], ids=["3-layers", "2-layers"])
def test_linear_attention_only_model_falls_back_and_ships(
    tiny_linear_only: Path, hybrid_plugin_env: dict[str, str], layer_ids: list[int]
) -> None:
    """Auto mode, a model without a full-attention group: vLLM's own grouping, one log
    line saying why, every sample exact. Two captured-layer counts: vLLM pads the
    hidden-state page for one or the other, depending on the CPU's block size."""
    env = {**hybrid_plugin_env, "HIDDEN_STATES_SUPPLEMENTARY": "auto"}
    prompts = prompts_of([1, 7, 200, 300, 600], seed=32)
    with HiddenStatesReader() as reader:
        spec = EngineSpec.of(
            tiny_linear_only, layer_ids, dtype="bfloat16", block_size=None, max_model_len=MAX_LEN,
            kv_cache_memory_bytes=BUDGET, max_num_batched_tokens=256,
        )  # fmt: skip
        run = Run(prompts, max_tokens=[1, 2, 1, 3, 1], with_output=[1])
        got, result, log = run_and_collect(reader, spec, run, len(prompts), env=env)
    lines = [ln for ln in log.splitlines() if "vLLM's own grouping applies" in ln]
    assert len(lines) == 1 and "has none (layers: ['MambaSpec'])" in lines[0], log[-3000:]
    assert "supplementary tensor for" not in log
    worst = check_samples(
        got,
        result,
        prompts,
        Reference(tiny_linear_only),
        layer_ids,
        with_output={1},
        dtype=torch.bfloat16,
        tolerance=0.05,
        token_tolerance=0.4,
    )
    waste = re.search(
        r"Using block size (\d+) for hidden-state cache layer \S+; page alignment wastes (\d+)", log
    )
    assert waste, log[-3000:]
    print(
        f"linear-only, {len(layer_ids)} layers: block {waste[1]}, {waste[2]} bytes of padding, "
        f"worst {worst:.3e}"
    )
