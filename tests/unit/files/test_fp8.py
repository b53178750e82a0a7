"""speculators' fp8 layout (``files.fp8``): the arithmetic is speculators' own formula,
whatever the strides or the chunking; per-layer scales broadcast as speculators'
dequantization expects and never do worse than per-token ones on a sample whose layers'
magnitudes differ; the error report is computed, per captured layer."""

from __future__ import annotations

import pytest
import torch

from kv_connector.files import fp8
from kv_connector.files.fp8 import Fp8Scale, dequantize, quantize, worst_relative_error


def spread_sample(tokens: int = 64, hidden: int = 256, seed: int = 0) -> torch.Tensor:
    """[T, 3, H] bf16 states whose layers differ by orders of magnitude, one token huge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 3, hidden, generator=g)
    x *= torch.tensor([0.03, 1.0, 40.0]).view(1, 3, 1)
    x[5, 2, 7] = 3000.0
    return x.to(torch.bfloat16)


def speculators_formula(t: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """hs_connectors.fp8_utils.quantize_tensor_to_fp8, written out (its per-token dims (1, 2))."""
    f = t.float()
    scale = (f.abs().amax(dim=dims, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    return (f / scale).to(torch.float8_e4m3fn), scale


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("scale", list(Fp8Scale))
def test_quantize_is_speculators_arithmetic_for_any_strides_and_chunks(
    scale: Fp8Scale, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = spread_sample()
    dims = (1, 2) if scale is Fp8Scale.TOKEN else (2,)
    want_q, want_s = speculators_formula(x, dims)
    q, s = quantize(x, scale)
    assert same(q, want_q) and torch.equal(s, want_s)
    assert s.shape == ((64, 1, 1) if scale is Fp8Scale.TOKEN else (64, 3, 1))
    # the CPU layout's strided view of the pool gives the same bytes
    strided = x.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    assert not strided.is_contiguous()
    q2, s2 = quantize(strided, scale)
    assert same(q2, want_q) and torch.equal(s2, want_s)
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 5 * 3 * 256)  # chunks of 5 tokens
    q3, s3 = quantize(x, scale)
    assert same(q3, want_q) and torch.equal(s3, want_s)


def test_zero_tokens_get_the_floor_scale_and_come_back_zero() -> None:
    x = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    q, s = quantize(x)
    assert torch.all(s == 1e-12) and torch.all(dequantize(q, s) == 0)


def test_per_layer_scales_lower_the_worst_error_where_layers_differ() -> None:
    x = spread_sample()
    token = worst_relative_error(x, Fp8Scale.TOKEN)
    layer = worst_relative_error(x, Fp8Scale.LAYER)
    assert len(token) == len(layer) == 3
    assert all(lv <= tv + 1e-6 for lv, tv in zip(layer, token, strict=True))
    assert token[0] > 2 * layer[0]  # the smallest layer, beside a huge token, suffers most per token
    assert max(layer) < 0.07  # e4m3's 3 mantissa bits: a few percent per row


def test_dequantize_is_what_fp8transfer_computes() -> None:
    x = spread_sample()
    for scale in Fp8Scale:
        q, s = quantize(x, scale)
        got = dequantize(q, s, torch.bfloat16)
        assert torch.equal(got, q.to(torch.bfloat16) * s.to(torch.bfloat16))
        torch.testing.assert_close(got.float(), x.float(), atol=0.5, rtol=0.1)  # speculators' tolerance


def test_a_sample_that_is_not_tokens_layers_hidden_is_refused() -> None:
    with pytest.raises(ValueError, match="tokens, layers, hidden"):
        quantize(torch.zeros(4, 16))
