"""The sanity check of a sample's states: NaN/Inf and tokens zero in every layer are found
and named by token and layer id, in any dtype and either block layout's view; healthy
states (one zero layer included) pass."""

from __future__ import annotations

import pytest
import torch

from kv_connector.reader.pool import values
from kv_connector.reader.pool.values import BadValues, check_values, find_bad_values

LAYER_IDS = [1, 2, 4]


def states(layout: str, dtype: torch.dtype, t: int = 300, hidden: int = 16) -> torch.Tensor:
    """[T, L, H] random states: a plain tensor (TLH) or the CPU layout's strided view (LTH)."""
    g = torch.Generator().manual_seed(0)
    if layout == "TLH":
        return torch.randn(t, len(LAYER_IDS), hidden, generator=g).to(dtype)
    return torch.randn(len(LAYER_IDS), t, hidden, generator=g).to(dtype).permute(1, 0, 2)


CASES = [(lay, dt) for lay in ("TLH", "LTH") for dt in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("layout, dtype", CASES)
def test_healthy_states_pass(layout: str, dtype: torch.dtype) -> None:
    hs = states(layout, dtype)
    hs[5, 0] = 0  # one layer of a token all zero (an embedding row of zeros): not an error
    assert find_bad_values(hs, LAYER_IDS) is None
    check_values(hs, LAYER_IDS)


@pytest.mark.parametrize("layout, dtype", CASES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_is_named_by_token_and_layer_id(
    layout: str, dtype: torch.dtype, bad: float
) -> None:
    hs = states(layout, dtype)
    hs[217, 2, 9] = bad
    problem = find_bad_values(hs, LAYER_IDS)
    assert problem == "NaN/Inf at 1 of 300 tokens: token 217 (layer ids 4)"
    with pytest.raises(BadValues, match="token 217"):
        check_values(hs, LAYER_IDS)


@pytest.mark.parametrize("layout, dtype", CASES)
def test_a_token_zero_in_every_layer_is_named(layout: str, dtype: torch.dtype) -> None:
    hs = states(layout, dtype)
    hs[0] = 0
    hs[299] = -0.0
    assert find_bad_values(hs, LAYER_IDS) == "2 of 300 tokens all zero in every layer: token 0, 299"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])  # widened in chunks; in one pass
def test_across_chunks_every_bad_token_is_counted_and_a_few_named(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(values, "CHUNK_ELEMENTS", 7 * len(LAYER_IDS) * 16)  # chunks of 7 tokens
    hs = states("LTH", dtype)
    hs[10:30, 0, 3] = float("nan")
    hs[40:60] = 0
    problem = find_bad_values(hs, LAYER_IDS)
    assert problem is not None
    assert problem.startswith("NaN/Inf at 20 of 300 tokens: token 10 (layer ids 1), token 11 (layer ids 1)")
    assert "and 15 more" in problem
    assert problem.endswith("20 of 300 tokens all zero in every layer: token 40, 41, 42, 43, 44 and 15 more")


def test_a_shape_that_does_not_match_the_layer_ids_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 layer ids"):
        find_bad_values(torch.zeros(4, 2, 8), LAYER_IDS)
    assert find_bad_values(torch.zeros(0, 3, 8), LAYER_IDS) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sums_that_overflow_or_cancel_are_not_reported(dtype: torch.dtype) -> None:
    """The screen sums each token's rows; a finite row whose sum overflows, or a non-zero
    row whose sum is exactly zero, is checked exactly and passes."""
    hs = states("LTH", dtype)
    big = torch.finfo(dtype).max / 4
    hs[3, 1] = big  # every element finite, their sum is not
    hs[4] = 0
    hs[4, :, 0], hs[4, :, 1] = 1.0, -1.0  # sums of 0 in every layer, values that are not
    assert find_bad_values(hs, LAYER_IDS) is None


@pytest.mark.parametrize("layout, dtype", CASES)
def test_a_captured_layer_zero_at_every_token_is_named_by_layer_id(layout: str, dtype: torch.dtype) -> None:
    """A layer the extraction never wrote (vLLM #46301's all-zero states, one layer of a
    hybrid verifier): zero at every token of the sample, while the others are not."""
    hs = states(layout, dtype)
    hs[:, 1] = 0
    problem = find_bad_values(hs, LAYER_IDS)
    assert problem is not None and "captured layer ids 2 all zero at every one of the 300 tokens" in problem
    hs = states(layout, dtype, t=1)
    hs[:, 1] = 0  # one token alone: as one zero layer of one token, not an error
    assert find_bad_values(hs, LAYER_IDS) is None


@pytest.mark.parametrize("layout, dtype", CASES)
def test_the_sampled_screen_finds_what_a_bad_row_shows(layout: str, dtype: torch.dtype) -> None:
    """The sampled screen (a host pool's default): healthy states pass; an all-zero token,
    an all-zero layer and a row of garbage are found and named as the full screen names
    them; a lone NaN in an element it does not read is the documented miss."""
    hs = states(layout, dtype, hidden=1024)
    assert find_bad_values(hs, LAYER_IDS, sample=True) is None
    for damage in ("token", "layer", "row"):
        bad = hs.clone()
        if damage == "token":
            bad[7] = 0
        elif damage == "layer":
            bad[:, 2] = 0
        else:
            bad[9, 1] = float("nan")
        assert find_bad_values(bad, LAYER_IDS, sample=True) == find_bad_values(bad, LAYER_IDS) is not None
    lone = hs.clone()
    lone[3, 0, 300] = float("nan")  # between the two runs it reads
    assert find_bad_values(lone, LAYER_IDS) is not None
    assert find_bad_values(lone, LAYER_IDS, sample=True) is None


def lines_of(hs: torch.Tensor) -> torch.Tensor:
    """32 values of every row (what a fingerprint's line read gives the screen)."""
    return hs[:, :, 64:96]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_screen_of_rows_read_with_the_checks_says_what_the_sampled_screen_would(
    dtype: torch.dtype,
) -> None:
    hs = states("TLH", dtype, t=40, hidden=256)
    halves = [values.screen_rows(lines_of(hs[:20])), values.screen_rows(lines_of(hs[20:]))]
    assert values.screened_clean(halves, 40, 3) and find_bad_values(hs, LAYER_IDS, sample=True) is None
    bad = {
        "NaN": lambda x: x[7, 1, 70:71].fill_(float("nan")),
        "zero token": lambda x: x[33].zero_(),
        "zero layer": lambda x: x[:, 2].zero_(),
    }
    for name, spoil in bad.items():
        x = hs.clone()
        spoil(x)
        parts = [values.screen_rows(lines_of(x[:20])), values.screen_rows(lines_of(x[20:]))]
        assert not values.screened_clean(parts, 40, 3), name
        assert find_bad_values(x, LAYER_IDS) is not None, name  # what it then asks to look closer at
    one = states("TLH", dtype, t=1, hidden=256)
    one[0, 2].zero_()  # one token, one zero layer: not a dead layer
    assert values.screened_clean([values.screen_rows(lines_of(one))], 1, 3)
    # a share without tokens says nothing; a screen of other layers' count is not taken
    empty = values.screen_rows(lines_of(hs[:0]))
    assert not empty.suspect and empty.alive == (False,) * 3
    assert values.screened_clean([*halves, empty], 40, 3)
    assert not values.screened_clean([values.screen_rows(lines_of(hs[:, :2]))], 40, 3)
