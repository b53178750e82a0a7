"""Stand-in for vLLM 0.33's compiled ``vllm._C_stable_libtorch`` on a GPU host it cannot
reach (built for another torch, 63 MB compressed): it defines, in torch's ``_C`` op
namespace, the few ops vLLM's Python binds or calls on the engine tier's path (Triton
attention, ``custom_ops: ["none"]``, a dense model), in native torch.

The engine tier copies this file over ``vllm/_C_stable_libtorch.py`` of the unpacked
vLLM tree; it imports nothing but torch. Three kinds of op:

- computed natively: ``silu_and_mul``, ``rms_norm``, ``fused_add_rms_norm`` (bound by
  vLLM's layers at construction and reachable through its ``vllm_c`` IR provider);
- memory ops: ``weak_ref_tensor`` (a non-owning alias, which CUDA-graph capture keeps of
  its outputs) and ``get_cuda_view_from_cpu_tensor`` (a CUDA view of pinned host memory
  by unified addressing, which Model Runner V2's UVA buffers are made of);
- named only: ops vLLM's compilation passes look up at import or compare graph nodes
  against, never called on this path; calling one raises ``NotImplementedError`` naming it.

``DEFINED`` lists what was defined, ``FAILED`` what could not be (name -> error) and
``FALLBACKS`` where a weak alias fell back to an owning one, so the engine tier can
report them. Unrun on a GPU until the engine tier runs there.
"""

from __future__ import annotations

from typing import Any

import torch

DEFINED: list[str] = []
FAILED: dict[str, str] = {}
# weak_ref_tensor calls that could not alias without ownership and returned an owning
# alias instead (correct values; memory held longer): the first error, and how many
FALLBACKS: dict[str, object] = {}

# the ops vLLM 0.33 looks up without a hasattr guard on the engine tier's path but never
# calls there: the compilation passes' tables (fusion/rms_quant_fusion.py,
# fusion/matcher_utils.py, fusion/act_quant_fusion.py, fusion/qk_norm_rope_fusion.py) and
# utility/fix_functionalization.py's comparisons
NAMED_ONLY = {
    "rotary_embedding": (
        "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox) -> ()"
    ),
    "fused_qk_norm_rope": "fused_qk_norm_rope(Tensor(a!) qkv, Tensor[] rest) -> ()",
    "static_scaled_fp8_quant": "static_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor scale) -> ()",
    "dynamic_scaled_fp8_quant": (
        "dynamic_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor(b!) scale) -> ()"
    ),
    "dynamic_per_token_scaled_fp8_quant": (
        "dynamic_per_token_scaled_fp8_quant(Tensor(a!) result, Tensor input, Tensor(b!) scale, "
        "Tensor? scale_ub) -> ()"
    ),
    "rms_norm_static_fp8_quant": (
        "rms_norm_static_fp8_quant(Tensor(a!) result, Tensor input, Tensor weight, Tensor scale, "
        "float epsilon) -> ()"
    ),
    "fused_add_rms_norm_static_fp8_quant": (
        "fused_add_rms_norm_static_fp8_quant(Tensor(a!) result, Tensor input, Tensor(b!) residual, "
        "Tensor weight, Tensor scale, float epsilon) -> ()"
    ),
    "rms_norm_dynamic_per_token_quant": (
        "rms_norm_dynamic_per_token_quant(Tensor(a!) result, Tensor input, Tensor weight, "
        "Tensor(b!) scale, float epsilon, Tensor? scale_ub, Tensor(c!)? residual) -> ()"
    ),
    "silu_and_mul_quant": "silu_and_mul_quant(Tensor(a!) result, Tensor input, Tensor scale) -> ()",
    "silu_and_mul_per_block_quant": (
        "silu_and_mul_per_block_quant(Tensor(a!) out, Tensor input, Tensor(b!) scales, int group_size, "
        "Tensor? scale_ub, bool is_scale_transposed) -> ()"
    ),
}

# capability queries vLLM asks before it picks a kernel (quantized GEMMs, MoE): the stand-in
# has none of those kernels, so every answer is no
UNSUPPORTED = (
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_group_gemm_supported",
    "mxfp4_experts_quant_supported",
)

LIB = torch.library.Library("_C", "FRAGMENT")


class _Span:
    """A ``__cuda_array_interface__`` of ``nbytes`` bytes at ``ptr``; holds ``owner`` (or
    nothing: a weak alias)."""

    def __init__(self, ptr: int, nbytes: int, owner: Any = None) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last (its strides' reach)."""
    if t.numel() == 0:
        return 0
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (reach + 1) * t.element_size()


def _alias(ptr: int, like: torch.Tensor, owner: Any) -> torch.Tensor:
    """A CUDA tensor at ``ptr`` with ``like``'s dtype, shape and strides."""
    nbytes = _span_bytes(like)
    raw = torch.as_tensor(_Span(ptr, nbytes, owner), device="cuda")
    return raw.view(like.dtype).as_strided(like.shape, like.stride())


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory without keeping it alive (what vLLM's kernel returns: from_blob,
    no deleter)."""
    if t.numel() == 0:
        return t
    try:
        return _alias(t.data_ptr(), t, None)
    except Exception as e:  # an owning alias still holds the same values
        FALLBACKS.setdefault("weak_ref_tensor", f"{type(e).__name__}: {e}")
        FALLBACKS["weak_ref_tensor_calls"] = int(str(FALLBACKS.get("weak_ref_tensor_calls", 0))) + 1
        return t.detach()


def get_cuda_view_from_cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over pinned host tensor ``t``'s memory (unified addressing: the host
    pointer of pinned memory is its device pointer), keeping ``t`` alive."""
    if not t.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor needs a pinned host tensor")
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device="cuda")
    return _alias(t.data_ptr(), t, t)


def silu_and_mul(result: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    result.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])


def _rms(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    out = out.to(x.dtype)
    return out * weight if weight is not None else out


def rms_norm(result: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, epsilon: float) -> None:
    result.copy_(_rms(x, weight, epsilon))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float
) -> None:
    """``residual += x``, then ``x = rms_norm(residual)`` (both in place, as vLLM's kernel)."""
    added = x.float() + residual.float()
    residual.copy_(added.to(residual.dtype))
    x.copy_(_rms(residual, weight, epsilon))


def _nothing(*args: Any) -> None:
    return None


def _no(*args: Any) -> bool:
    return False


def _define(name: str, schema: str, impls: dict[str, Any]) -> None:
    try:
        LIB.define(schema)
        for key, fn in impls.items():
            LIB.impl(name, fn, key)
    except Exception as e:  # report each op, define the rest
        FAILED[name] = f"{type(e).__name__}: {e}"
    else:
        DEFINED.append(name)


def _named_only(name: str) -> Any:
    def refuse(*args: Any) -> None:
        raise NotImplementedError(
            f"vLLM called its compiled op _C.{name}, which the engine tier's stand-in only names "
            "(vLLM's compiled kernels do not travel to this host)"
        )

    return refuse


def _define_all() -> None:
    both = ("CPU", "CUDA")
    _define("weak_ref_tensor", "weak_ref_tensor(Tensor input) -> Tensor", {"CUDA": weak_ref_tensor})
    _define(
        "get_cuda_view_from_cpu_tensor",
        "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor",
        {"CPU": get_cuda_view_from_cpu_tensor},
    )
    _define(
        "silu_and_mul",
        "silu_and_mul(Tensor(a!) result, Tensor input) -> ()",
        {**dict.fromkeys(both, silu_and_mul), "Meta": _nothing},
    )
    _define(
        "rms_norm",
        "rms_norm(Tensor(a!) result, Tensor input, Tensor? weight, float epsilon) -> ()",
        {**dict.fromkeys(both, rms_norm), "Meta": _nothing},
    )
    _define(
        "fused_add_rms_norm",
        "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, float epsilon) -> ()",
        {**dict.fromkeys(both, fused_add_rms_norm), "Meta": _nothing},
    )
    for name, schema in NAMED_ONLY.items():
        _define(name, schema, {**dict.fromkeys(both, _named_only(name)), "Meta": _nothing})
    for name in UNSUPPORTED:  # no tensor argument: one implementation for every backend
        _define(name, f"{name}(int cuda_device_capability) -> bool", {"CompositeExplicitAutograd": _no})


_define_all()
