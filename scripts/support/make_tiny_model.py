"""Build deterministic tiny random models (no hub): dense Llama / Qwen3, a hybrid
Qwen3-Next (gated-delta-net linear attention + full attention, MoE), a Qwen3-Next whose
layers are all linear attention (no full-attention layer at all), and a gpt-oss
(sliding-window and full attention alternating, MoE with attention sinks).

python -m scripts.support.make_tiny_model --family llama --out /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

TINY_DENSE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

# Hybrid: 8 layers, full attention at 3 and 7 (like the real model, three layers of
# linear attention per full one). vLLM's CPU build runs gated-delta-net layers only in
# bf16 with head dim 128 (ENVIRONMENT.md), so the linear heads are 128 wide.
TINY_QWEN3_NEXT: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    decoder_sparse_step=1,
    vocab_size=1024,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


# Every layer linear attention: a state-only model (no full-attention KV cache group).
TINY_QWEN3_NEXT_LINEAR: dict[str, Any] = dict(
    TINY_QWEN3_NEXT,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 4,
)

# gpt-oss: layers 0, 2 slide over a 32-token window, 1, 3 attend to everything (vLLM
# applies the window to even layers; transformers reads layer_types: the same here).
TINY_GPT_OSS: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=32,
    layer_types=["sliding_attention", "full_attention"] * 2,
    vocab_size=1024,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": TINY_DENSE,
    "qwen3": TINY_DENSE,
    "qwen3_next": TINY_QWEN3_NEXT,
    "qwen3_next_linear": TINY_QWEN3_NEXT_LINEAR,
    "gpt_oss": TINY_GPT_OSS,
}


def build_tiny_model(
    out: str | os.PathLike[str],
    family: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Write a tiny random model of ``family`` to ``out`` (config + safetensors weights).

    The same arguments always give the same weights. Returns the directory. An existing
    directory with the same build arguments is reused.
    """
    import torch
    import transformers

    out = Path(out)
    stamp = {"family": family, "seed": seed, "dtype": dtype, **overrides}
    marker = out / "tiny_model_args.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return out

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")
    params = {**FAMILIES[family], **overrides}
    if family == "llama":
        config: Any = transformers.LlamaConfig(**params)
    elif family == "qwen3":
        config = transformers.Qwen3Config(
            head_dim=params["hidden_size"] // params["num_attention_heads"], **params
        )
    elif family in ("qwen3_next", "qwen3_next_linear"):
        config = transformers.Qwen3NextConfig(**params)
    else:
        config = transformers.GptOssConfig(**params)
    config.torch_dtype = dtype
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model = model.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(stamp))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    print(build_tiny_model(args.out, args.family, args.seed, args.dtype))


if __name__ == "__main__":
    main()
