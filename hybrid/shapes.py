"""The KV-cache shape of a hybrid model read from its config.json, and the design's block arithmetic.

The arithmetic is the supplementary-tensor design's. Pure logic: no vllm, torch or nixl.

A hybrid model (Qwen3-Next, Qwen3.5) interleaves gated-delta-net linear-attention layers
with full-attention layers. A linear layer's cache is a fixed-size recurrent state per
request; a full-attention layer's grows by one page per ``block_size`` tokens. A
mixed-window model (gpt-oss) interleaves sliding-window layers with full-attention ones.
``HybridShape`` holds the fields of config.json that decide those caches' sizes.
Everything else (MoE, vocabulary, vision tower) is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_connector.common.errors import ConfigurationError

FULL = "full_attention"
LINEAR = "linear_attention"
SLIDING = "sliding_attention"
_LAYER_TYPES = (FULL, LINEAR, SLIDING)
_LINEAR_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


def dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigurationError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class HybridShape:
    """What decides a hybrid model's cache sizes, as config.json states it.

    ``layer_types[i]`` is ``"full_attention"``, ``"linear_attention"`` or
    ``"sliding_attention"`` (a window of ``sliding_window`` tokens). The ``linear_*``
    fields matter, and must be positive, only with linear layers; ``sliding_window`` only
    with sliding ones. A model mixes linear with attention layers or sliding with full
    ones, not all three. ``mamba_ssm_dtype`` is the recurrent state's dtype when the
    config pins it; Qwen3.5 does, and vLLM then uses it for the state cache. Else it is
    None (the model dtype).
    """

    architecture: str
    hidden_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: str
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    mamba_ssm_dtype: str | None = None
    sliding_window: int = 0

    def __post_init__(self) -> None:
        bad = sorted(set(self.layer_types) - set(_LAYER_TYPES))
        if bad:
            raise ConfigurationError(f"unknown layer types {bad}; expected {_LAYER_TYPES}")
        if not self.layer_types:
            raise ConfigurationError("the model has no layers")
        if self.linear_attention_layers and self.sliding_attention_layers:
            raise ConfigurationError(
                "linear and sliding-window layers in one model: not a shape this report knows"
            )
        needed = ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"]
        needed += [*_LINEAR_FIELDS] if self.linear_attention_layers else []
        needed += ["sliding_window"] if self.sliding_attention_layers else []
        for name in (*needed, "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)}")
        dtype_bytes(self.dtype)
        if self.mamba_ssm_dtype is not None:
            dtype_bytes(self.mamba_ssm_dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def sliding_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    def hidden_state_token_bytes(self, num_captured_layers: int) -> int:
        """Bytes one token's captured states take: ``[num_captured_layers, hidden]``."""
        return num_captured_layers * self.hidden_size * dtype_bytes(self.dtype)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], dtype: str | None = None) -> HybridShape:
        """Read a Hugging Face config.json dict: top-level (Qwen3-Next) or with the
        language model under ``text_config`` (Qwen3.5). ``dtype`` overrides the
        config's own (``torch_dtype`` or ``dtype``)."""
        archs = config.get("architectures") or ["?"]
        text = config.get("text_config") or config
        n = int(_need(text, "num_hidden_layers"))
        types = text.get("layer_types")
        if types is None:
            interval = int(_need(text, "full_attention_interval"))
            types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
        if len(types) != n:
            raise ConfigurationError(f"layer_types has {len(types)} entries for {n} layers")
        heads = int(_need(text, "num_attention_heads"))
        hidden = int(_need(text, "hidden_size"))
        own_dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"
        linear = {f: int(_need(text, f)) for f in _LINEAR_FIELDS} if LINEAR in types else {}
        return cls(
            architecture=str(archs[0]),
            hidden_size=hidden,
            layer_types=tuple(str(t) for t in types),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or hidden // heads),
            max_position_embeddings=int(_need(text, "max_position_embeddings")),
            dtype=str(dtype or own_dtype),
            mamba_ssm_dtype=text.get("mamba_ssm_dtype"),
            sliding_window=int(_need(text, "sliding_window")) if SLIDING in types else 0,
            **linear,
        )

    def standin_config(self) -> dict[str, Any]:
        """A Qwen3-Next config.json with this cache shape, or a gpt-oss one for a mixed-window model.

        It builds vLLM's config of a model whose own vLLM module cannot be imported here
        (Qwen3.5 needs torchvision). Qwen3.5's and Qwen3-Next's vLLM classes compute their
        gated-delta-net states and attention pages with the same calls on these fields, so
        every cache spec is the same. The MoE fields are the smallest valid ones, since no
        weights are built."""
        n = self.num_layers
        if self.sliding_attention_layers:
            return {
                "architectures": ["GptOssForCausalLM"],
                "model_type": "gpt_oss",
                "hidden_size": self.hidden_size,
                "num_hidden_layers": n,
                "layer_types": list(self.layer_types),
                "sliding_window": self.sliding_window,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "max_position_embeddings": self.max_position_embeddings,
                "intermediate_size": 8,
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "vocab_size": 1024,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "original_max_position_embeddings": 4096,
                },
                "torch_dtype": self.dtype,
                "tie_word_embeddings": False,
            }
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": n,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "intermediate_size": 4 * self.hidden_size,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": 1024,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "torch_dtype": self.dtype,
            "tie_word_embeddings": False,
        }


def _need(config: Mapping[str, Any], key: str) -> Any:
    if key not in config or config[key] is None:
        raise ConfigurationError(
            f"config.json has no {key!r}: is this a hybrid (Qwen3-Next / Qwen3.5) or mixed-window "
            "(gpt-oss) model?"
        )
    return config[key]


def parse_layer_ids(text: str, num_layers: int) -> list[int]:
    """``"2,24,45,47"`` -> [2, 24, 45, 47]; ids are vLLM's aux layer ids, 0..num_layers."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigurationError(f"--layers must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ConfigurationError("--layers names no layer")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ConfigurationError(
            f"layer ids {bad} outside 0..{num_layers} (the model has {num_layers} layers)"
        )
    return ids


def exact_num_blocks(
    budget_bytes: int, group_bytes_per_block: int, supplementary_pages: Sequence[int]
) -> int:
    """Blocks a budget holds: ``budget // (group bytes + sum of pages)``.

    Every block costs the groups' bytes plus one page of every supplementary tensor."""
    if group_bytes_per_block <= 0:
        raise ConfigurationError(f"group bytes per block must be positive, got {group_bytes_per_block}")
    if any(p <= 0 for p in supplementary_pages):
        raise ConfigurationError(f"supplementary pages must be positive, got {list(supplementary_pages)}")
    return max(budget_bytes, 0) // (group_bytes_per_block + sum(supplementary_pages))
