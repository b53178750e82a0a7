"""``scripts.bench.keep`` at a tiny size: two trainer ranks of speculators' own DataLoader
on one vLLM server in pull delivery, three epochs with the rank-kept sampler (vLLM is
asked for each row once, and epochs 2-3 read every row from the ranks' folders), then
speculators' file backend on rank 0's folder and three epochs with speculators' own
sampler; every figure of the summary line is there, and nothing is left running. Minutes,
not seconds; the figures themselves are ``python -m scripts.bench.keep``'s."""

from __future__ import annotations

import pytest

from scripts.bench import keep
from tests.e2e.common import speculators_site

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.fresh_engine("the arm's own server")
def test_the_keep_arm_fetches_each_row_once_with_the_rank_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    speculators_site()  # skips without speculators
    monkeypatch.setattr(keep, "ROWS", 6)
    monkeypatch.setattr(keep, "WORKERS", 1)
    monkeypatch.setattr(keep, "PAIRS", 1)
    out = keep.main()
    figures = keep.figures(out)
    assert set(keep.FIGURES) <= set(figures)
    assert out["keep_prompts_over_rows"] == 1.0 and out["keep_hit_rate_rank_kept"] == 1.0, out
    assert out["samplers"] == ["RankKeptBatchSampler", "RankKeptBatchSampler"]
    assert out["default_sampler"] == "MultipackDistributedBatchSamplerV2"
    assert 0.0 <= out["keep_hit_rate_default_sampler"] <= 1.0
    assert out["keep_prompts_over_rows_default_sampler"] >= 1.0
    assert out["keep_over_file"] > 0 and 0.99 < out["keep_bytes_over_file"] < 1.1
    kept = out["epochs_detail"]["rank_kept"]
    assert [sum(e["rows"] for e in rank[:3]) for rank in kept] == [9, 9]  # 3 rows a rank, 3 epochs
    assert all(e["fetched"] == 0 for rank in kept for e in rank[1:])
