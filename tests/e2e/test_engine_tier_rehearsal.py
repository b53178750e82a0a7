"""The engine tier's stages run their own code end to end on vLLM's CPU build
(``ENGINE_TIER_REHEARSAL=cpu``: vLLM's CPU defaults, eager, the transformers reference on
the host), each in its own process group as on a GPU host: a real engine, our connector,
a reader in the engine's parent process (push) or a pull client, every sample against
transformers. What it proves is that the tier's glue works; what it says of a GPU is
nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.gpu import engine_tier


@pytest.mark.parametrize("stage", ["engine", "pull", "hybrid"])
def test_an_engine_stage_runs_its_own_code_on_vllms_cpu_build(
    stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_TIER_REHEARSAL", "cpu")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    out = engine_tier.spawn_stage(stage, tmp_path, engine_tier.stage_env([]), limit_s=400)
    assert out["ok"], out.get("error") or out["log_tail"]
    assert out["delivery"] == ("pull" if stage == "pull" else "push")
    assert out["samples"] == len(engine_tier.PROMPT_LENGTHS)
    comparison = out["comparison"]
    assert [r["tokens"] for r in comparison["per_prompt"]] == engine_tier.PROMPT_LENGTHS
    assert comparison["problems"] == []
    if stage == "hybrid":  # bf16 in vLLM against transformers in fp32
        assert out["model"] == "qwen3_next" and comparison["tolerance"] == engine_tier.HYBRID.tolerance
        assert comparison["worst_relative_error"] < engine_tier.HYBRID.tolerance
        # the plugin was on: its line is among those the tier reports
        assert any("hybrid supplementary tensors active" in line for line in out["log_lines"])
    else:
        assert comparison["worst_relative_error"] < 1e-4  # fp32 on the host at both ends
    # which runner ran, from vLLM's log and from the samples' provenance (the CPU build: V1)
    assert out["runner_from_log"] == "v1"
    assert any('"model_runner": "v1"' in p for p in out["provenance"])
    assert "engine tier stage" in out["log_tail"]


def test_the_speed_stage_pairs_the_engine_with_and_without_our_connector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``a_over_a0``'s glue: two engines alive at once, every sample taken, pairs of rounds
    (the figure itself means nothing on two shared cores)."""
    monkeypatch.setenv("ENGINE_TIER_REHEARSAL", "cpu")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    out = engine_tier.spawn_stage("speed", tmp_path, engine_tier.stage_env([]), limit_s=400)
    assert out["ok"], out.get("error") or out["log_tail"]
    arms = out["tokens_per_s"]  # the rehearsal's own number of pairs (fewer than a GPU's)
    assert out["pairs"] >= 3 and len(arms["a"]) == len(arms["a0"]) == out["pairs"]
    assert min(arms["a"] + arms["a0"]) > 0 and out["a_over_a0"] > 0
    lo, hi = out["a_over_a0_range"]
    assert lo <= out["a_over_a0"] <= hi
