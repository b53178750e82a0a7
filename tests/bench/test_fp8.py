"""``scripts.bench.fp8`` at a tiny size: both arms write real files through the CLI's own
writer (fp8 half the bytes of bf16, plus the scales), and the error study reports each
scaling per captured layer from the sample it builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.bench import fp8 as bench_fp8


def test_the_writer_arms_write_real_files_and_compare_them(tmp_path: Path) -> None:
    got = bench_fp8.writer(rows=2, tokens=64, pairs=1, where=tmp_path)
    bf16 = 64 * 4 * 4096 * 2
    assert bf16 < got["bf16_bytes_per_row"] < bf16 + 4096  # the states, tokens and a header
    fp8 = bf16 // 2 + 64 * 4  # fp8 states, a float32 scale per token
    assert fp8 < got["fp8_bytes_per_row"] < fp8 + 4096
    assert 0.5 < got["fp8_bytes_over_bf16"] < 0.51
    assert got["fp8_rows_per_s"] > 0 and got["bf16_rows_per_s"] > 0
    # the ratio is of the unrounded rates: its third decimal may differ from the rounded ones'
    ratio = got["fp8_rows_per_s"] / got["bf16_rows_per_s"]
    assert got["fp8_rows_per_s_over_bf16"] == pytest.approx(ratio, rel=1e-3, abs=1e-3)
    assert list(tmp_path.iterdir()) == []  # cleaned up


def test_the_error_study_reports_each_scaling_per_layer() -> None:
    got = bench_fp8.error_study(tokens=128)
    assert got["layer_ids"] == [2, 16, 29, 32]
    for sample in ("all_tokens", "ordinary_tokens"):
        token, layer = got[sample]["token"], got[sample]["layer"]
        assert len(token) == len(layer) == 4
        assert all(0 < v < 0.1 for v in token + layer)
        assert all(lv <= tv + 1e-4 for lv, tv in zip(layer, token, strict=True))
