"""speculators' fp8 file layout: hidden states as float8_e4m3fn with float32 scales.

A file holds ``hidden_states`` float8_e4m3fn [T, L, H], ``hidden_states_scales`` float32
and ``token_ids`` int64 [T]; a reader dequantizes as ``fp8.to(dtype) * scale.to(dtype)``
(speculators' ``FP8Transfer``). The arithmetic is speculators' own
(``hs_connectors.fp8_utils.quantize_tensor_to_fp8``), so the bytes are the same:

    scale = (amax / 448).clamp(min=1e-12)      # 448: float8_e4m3fn's largest finite value
    fp8 = (states.float() / scale).to(float8_e4m3fn)

``Fp8Scale.TOKEN`` (speculators' layout) takes ``amax`` over each token's layers and
hidden (scales [T, 1, 1]); ``Fp8Scale.LAYER`` over each token's row of one layer (scales
[T, L, 1]: ``FP8Transfer`` broadcasts those as well), for samples whose captured layers'
magnitudes differ by orders (docs/usage.md says when it pays). Tokens are quantized a
bounded chunk at a time (each token's scale is its own, so chunks change nothing).
Pure torch.
"""

from __future__ import annotations

import enum

import torch

from kv_connector.common.errors import ConfigurationError

# speculators' name for the scales tensor
SCALES_KEY = "hidden_states_scales"
FP8 = torch.float8_e4m3fn
# 448
FP8_MAX = torch.finfo(FP8).max
MIN_SCALE = 1e-12
# float32 temporaries of 4 MiB: each pass over a chunk stays in cache (a 32 MiB bf16 sample
# quantized on one core here: 118 ms in 64 MiB chunks, 26 ms in these)
CHUNK_ELEMENTS = 1 << 20


class Fp8Scale(str, enum.Enum):
    """Which values share one scale."""

    # speculators' fp8 layout: one scale per token, [T, 1, 1]
    TOKEN = "token"
    # one per token and captured layer, [T, L, 1]
    LAYER = "layer"


def quantize(states: torch.Tensor, scale: Fp8Scale = Fp8Scale.TOKEN) -> tuple[torch.Tensor, torch.Tensor]:
    """``states`` [T, L, H] (any float dtype, any strides, any device) as (float8_e4m3fn
    [T, L, H] contiguous, float32 scales [T, 1, 1] or [T, L, 1]) on the same device."""
    if states.dim() != 3:
        raise ConfigurationError(f"hidden states must be [tokens, layers, hidden], got {tuple(states.shape)}")
    t, layers, hidden = states.shape
    dims = (1, 2) if scale is Fp8Scale.TOKEN else (2,)
    out = torch.empty((t, layers, hidden), dtype=FP8, device=states.device)
    scales = torch.empty(
        (t, 1 if scale is Fp8Scale.TOKEN else layers, 1), dtype=torch.float32, device=states.device
    )
    step = max(1, CHUNK_ELEMENTS // max(1, layers * hidden))
    for t0 in range(0, t, step):
        chunk = states[t0 : t0 + step]
        # |x|'s max read in the states' own dtype (half the bytes of float32): exact, as is
        # its conversion, so the scale is speculators' to the bit
        amax = torch.maximum(chunk.amax(dim=dims, keepdim=True), -chunk.amin(dim=dims, keepdim=True))
        s = (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)
        out[t0 : t0 + step] = (chunk.float() / s).to(FP8)
        scales[t0 : t0 + step] = s
    return out, scales


def dequantize(fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What speculators' ``FP8Transfer`` hands a trainer: ``fp8.to(dtype) * scale.to(dtype)``."""
    return fp8.to(dtype) * scales.to(dtype)


def worst_relative_error(
    states: torch.Tensor, scale: Fp8Scale, dtype: torch.dtype = torch.bfloat16
) -> list[float]:
    """Per captured layer, the worst over tokens of ``|dequantized - states| / |states|``
    (L2 over the hidden dimension) after a round trip through ``quantize`` and
    ``dequantize`` to ``dtype``: what a trainer reading the file sees, layer by layer."""
    fp8, scales = quantize(states, scale)
    ref = states.float()
    # [T, L]
    err = (dequantize(fp8, scales, dtype).float() - ref).norm(dim=2)
    norm = ref.norm(dim=2).clamp(min=torch.finfo(torch.float32).tiny)
    return [float(v) for v in (err / norm).amax(dim=0)]
