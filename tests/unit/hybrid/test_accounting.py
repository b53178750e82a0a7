"""The supplementary-tensor arithmetic on the published shapes of Qwen3-Next-80B-A3B and
Qwen3.5-9B, with vLLM's real spec classes, its own grouping, sizing and capacity
functions, and its own block-size alignment (no weights, no engine); on vLLM 0.32, and
on 0.33 under ``make test-vllm033``, with the same expected figures.

Expected figures are derived here from the shapes by hand (comments show the
arithmetic), so a change in vLLM's functions or in ours shows up as a difference. The
CUDA figures (FlashAttention, 16-token kernel blocks, the model's bf16 state) do not
depend on the CPU the tests run on; the CPU platform's do (its SSM state is float32 on
AVX-512 BF16), and their arithmetic takes the state dtype from the CPU, both kinds of
which are checked (``tests.isa``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybrid.shapes import HybridShape
from tests.isa import KINDS, as_if_cpu
from tests.unit.hybrid.shapes import QWEN3_5_9B, QWEN3_NEXT_80B_A3B

pytestmark = pytest.mark.slow

GIB = 1 << 30
BUDGET = 20 * GIB
LEN = 32768


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def report(config: dict[str, Any], tmp: Path, *args: str) -> dict[str, Any]:
    """Run ``python -m hybrid.report`` in this process; its stdout must be one JSON object."""
    from hybrid.report import main

    path = tmp / "config.json"
    path.write_text(json.dumps(config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--config", str(path), *args]) == 0
    # in-process, vLLM's own log may share stdout (the CLI sends it to stderr): the
    # report is the one JSON object line
    (line,) = [ln for ln in out.getvalue().splitlines() if ln.startswith('{"ours"')]
    result: dict[str, Any] = json.loads(line)
    return result


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("qwen3-next")
    return report(
        QWEN3_NEXT_80B_A3B, tmp, "--layers", "2,24,45,47", "--budget-gib", "20", "--dtype", "bfloat16"
    )


@pytest.fixture(scope="module")
def qwen3_5() -> dict[str, Any]:
    from hybrid.accounting import Setup, compare

    shape = HybridShape.from_config(QWEN3_5_9B)
    return compare(shape, Setup(layer_ids=(2, 16, 29, 31), budget_bytes=BUDGET))


def test_report_refuses_bad_arguments_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hybrid.report import main

    assert main(["--config", str(tmp_path), "--layers", "1", "--budget-gib", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT_80B_A3B))
    assert main(["--config", str(tmp_path), "--layers", "2,49", "--budget-gib", "1"]) == 2
    assert "outside 0..48" in capsys.readouterr().err


def test_qwen3_next_block_size_covers_the_state_page() -> None:
    # GDN state per layer with one speculative token: conv (kernel 4 - 1 + 1) x conv_dim
    # (128*16*2 + 128*32 = 8192) bf16, recurrent 32 x 128 x 128 bf16.
    state = (4 * 8192 + 32 * 128 * 128) * 2
    assert state == 1_114_112
    token = 2 * 2 * 256 * 2  # K and V, 2 kv heads, head dim 256, bf16
    block = 16 * cdiv(state, 16 * token)  # FlashAttention's 16-token kernel blocks
    assert block == 544


def test_qwen3_next_ours_counts_every_byte_once(qwen3_next: dict[str, Any]) -> None:
    ours = qwen3_next["ours"]
    page = 544 * 2 * 2 * 256 * 2  # one attention layer's page; the GDN pages equal it
    groups = 12 * page  # four groups of 12 layers alias one pool block
    hidden = 544 * 4 * 2048 * 2  # 544 tokens x 4 captured layers x hidden 2048, bf16
    assert [g["kind"] for g in ours["groups"]] == ["mamba", "mamba", "mamba", "full_attention"]
    assert all(g["page_bytes"] == page and g["layers"] == 12 for g in ours["groups"])
    assert ours["block_size"] == 544
    assert ours["hidden_state_bytes_per_block"] == ours["hidden_state_bytes_needed_per_block"] == hidden
    assert ours["bytes_per_block"] == groups + hidden == 22_282_240
    assert ours["num_blocks"] == BUDGET // (groups + hidden) == 963
    assert ours["num_blocks"] * ours["bytes_per_block"] <= BUDGET
    (supp,) = ours["supplementary"]
    # the attention group is found, not assumed: three GDN groups come first
    assert supp["addressed_by_group"] == 3
    assert supp["layer"] == "cache_only_layers.48"
    assert supp["tensor_bytes"] == 963 * hidden


def test_qwen3_next_capacity_counts_blocks_per_request(qwen3_next: dict[str, Any]) -> None:
    ours, vllm, none = qwen3_next["ours"], qwen3_next["vllm"], qwen3_next["no_extraction"]
    # align mode (prefix caching): 2 state blocks + 1 speculative per GDN group
    assert ours["blocks_per_request"] == cdiv(LEN, 544) + 3 * 3 == 70
    assert ours["token_capacity"] == int(963 / 70 * LEN) == 450_794
    # vLLM: the hidden states get a group of their own, 68 tokens per pool block
    # (1_114_112 // 16_384), each block costing the whole 13_369_344-byte pool block
    hs = vllm["groups"][-1]
    assert (hs["kind"], hs["block_size"], hs["blocks_per_request"]) == ("hidden_states", 68, cdiv(LEN, 68))
    assert vllm["num_blocks"] == BUDGET // (12 * 1_114_112) == 1606
    assert vllm["blocks_per_request"] == 61 + 9 + 482
    assert vllm["token_capacity"] == int(1606 / 552 * LEN) == 95_335
    assert vllm["hidden_state_bytes_per_block"] == 12 * vllm["hidden_state_bytes_needed_per_block"]
    # no extraction: no speculative state block either
    assert none["blocks_per_request"] == 61 + 3 * 2 and none["token_capacity"] == int(1606 / 67 * LEN)
    assert ours["token_capacity"] >= 4 * vllm["token_capacity"]
    assert qwen3_next["setup"]["ours_over_vllm"] == round(450_794 / 95_335, 3)
    assert qwen3_next["setup"]["mamba_cache_mode"] == "align"


def test_qwen3_5_figures(qwen3_5: dict[str, Any]) -> None:
    ours, vllm = qwen3_5["ours"], qwen3_5["vllm"]
    # mamba_ssm_dtype float32: GDN state = conv 4 x 8192 bf16 + recurrent 32x128x128 fp32
    state = 4 * 8192 * 2 + 32 * 128 * 128 * 4
    token = 2 * 4 * 256 * 2
    block = 16 * cdiv(state, 16 * token)
    assert (state, block) == (2_162_688, 528)
    groups = 8 * block * token
    hidden = block * 4 * 4096 * 2
    assert ours["block_size"] == vllm["block_size"] == block
    assert ours["bytes_per_block"] == groups + hidden == 34_603_008
    assert ours["num_blocks"] == BUDGET // (groups + hidden) == 620
    assert ours["blocks_per_request"] == cdiv(LEN, block) + 9
    assert ours["token_capacity"] == int(620 / 72 * LEN) == 282_168
    assert vllm["groups"][-1]["block_size"] == 66  # 2_162_688 // 32_768
    assert vllm["token_capacity"] == int(1241 / (63 + 9 + cdiv(LEN, 66)) * LEN) == 71_467
    assert ours["token_capacity"] >= vllm["token_capacity"]
    assert ours["supplementary"][0]["addressed_by_group"] == 3


@pytest.fixture(scope="module")
def qwen3_next_config() -> Iterator[tuple[Any, dict[str, Any], HybridShape]]:
    from hybrid.accounting import Setup, engine_config, layer_specs

    shape = HybridShape.from_config(QWEN3_NEXT_80B_A3B)
    setup = Setup(layer_ids=(2, 24, 45, 47), budget_bytes=BUDGET, max_model_len=262144)
    with engine_config(shape, setup) as cfg:
        yield cfg, layer_specs(cfg, shape, "cuda"), shape


def test_default_max_length_is_refused_by_vllm_and_fits_ours(
    qwen3_next_config: tuple[Any, dict[str, Any], HybridShape],
) -> None:
    from hybrid.accounting import approach

    cfg, specs, shape = qwen3_next_config
    token = shape.hidden_state_token_bytes(4)
    vllm = approach(cfg, specs, BUDGET, token, ours=False)
    ours = approach(cfg, specs, BUDGET, token, ours=True)
    assert vllm.refused is not None and "262144" in vllm.refused and vllm.token_capacity == 0
    assert ours.refused is None and ours.token_capacity >= 262144


def test_split_keeps_regular_specs_and_unpads_the_cache_only_page(
    qwen3_next_config: tuple[Any, dict[str, Any], HybridShape],
) -> None:
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    from hybrid.spec import CacheOnlySpec, split_supplementary_specs

    _, specs, _ = qwen3_next_config
    name = "cache_only_layers.48"
    assert isinstance(specs[name], HiddenStateCacheSpec) and not isinstance(specs[name], CacheOnlySpec)
    padded = dict(specs, **{name: replace(specs[name], block_size=68, page_size_padded=1 << 21)})
    regular, supp = split_supplementary_specs(padded)
    assert list(regular) == [n for n in specs if n != name]
    assert all(regular[n] is specs[n] for n in regular)
    (spec,) = supp.values()
    assert isinstance(spec, CacheOnlySpec) and isinstance(spec, HiddenStateCacheSpec)
    assert spec.page_size_bytes == 68 * 4 * 2048 * 2  # exact: the padding is gone
    assert CacheOnlySpec.of(spec, 544).page_size_bytes == 544 * 4 * 2048 * 2


def test_a_model_without_attention_group_falls_back_to_vllm_in_auto_mode(
    qwen3_next_config: tuple[Any, dict[str, Any], HybridShape], caplog: pytest.LogCaptureFixture
) -> None:
    """A state-only model (Mamba-only, linear-attention-only) has no block table to
    lend: auto mode gives vLLM's own configs unchanged and says why; the design forced
    on refuses it by name."""
    from hybrid import spec
    from hybrid.spec import (
        NoAttentionGroupError,
        SupplementedKVCacheConfig,
        attention_group_index,
        plan_kv_cache_configs,
    )
    from hybrid.versions import kv_cache_configs, kv_cache_groups

    cfg, specs, _ = qwen3_next_config
    state_only = {n: s for n, s in specs.items() if "self_attn" not in n}
    groups = kv_cache_groups(cfg, [{n: s for n, s in state_only.items() if "cache_only" not in n}])
    with pytest.raises(NoAttentionGroupError, match="full-attention"):
        attention_group_index(groups)
    with pytest.raises(NoAttentionGroupError, match="has none"):
        plan_kv_cache_configs(cfg, [state_only], [BUDGET], fallback=False)
    budget = 10 * BUDGET  # vLLM's own grouping needs ~144 GiB for one 262144-token request
    spec.FALLBACK_LOGGED.reset()  # the line is logged once per process
    with caplog.at_level(logging.INFO, logger="vllm.hybrid.spec"):
        (ours,) = plan_kv_cache_configs(cfg, [dict(state_only)], [budget])
    (theirs,) = kv_cache_configs(cfg, [dict(state_only)], [budget])
    assert not isinstance(ours, SupplementedKVCacheConfig)
    assert ours.num_blocks == theirs.num_blocks
    assert [(g.layer_names, g.kv_cache_spec) for g in ours.kv_cache_groups] == [
        (g.layer_names, g.kv_cache_spec) for g in theirs.kv_cache_groups
    ]
    (line,) = [r.getMessage() for r in caplog.records if "own grouping applies" in r.getMessage()]
    assert "has none" in line and "MambaSpec" in line


def test_dense_models_go_to_vllm_unchanged(
    qwen3_next_config: tuple[Any, dict[str, Any], HybridShape],
) -> None:
    from hybrid.spec import SupplementedKVCacheConfig, plan_kv_cache_configs
    from hybrid.versions import kv_cache_configs

    cfg, specs, _ = qwen3_next_config
    dense = {n: s for n, s in specs.items() if "linear_attn" not in n}
    (ours,) = plan_kv_cache_configs(cfg, [dense], [BUDGET])
    (theirs,) = kv_cache_configs(cfg, [dense], [BUDGET])
    assert not isinstance(ours, SupplementedKVCacheConfig)
    assert ours.num_blocks == theirs.num_blocks
    assert [g.layer_names for g in ours.kv_cache_groups] == [g.layer_names for g in theirs.kv_cache_groups]


def test_workers_with_less_memory_shrink_every_tensor(
    qwen3_next_config: tuple[Any, dict[str, Any], HybridShape],
) -> None:
    from hybrid.spec import SupplementedKVCacheConfig, plan_kv_cache_configs

    cfg, specs, _ = qwen3_next_config
    configs = plan_kv_cache_configs(cfg, [specs, specs], [BUDGET, BUDGET * 3 // 4])
    per_block = 12 * 1_114_112 + 544 * 4 * 2048 * 2
    assert [c.num_blocks for c in configs] == [BUDGET * 3 // 4 // per_block] * 2
    for c in configs:
        assert isinstance(c, SupplementedKVCacheConfig) and c.supplementary_group == 3
        assert c.kv_cache_tensors[0].size == c.num_blocks * 12 * 1_114_112


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cpu_platform_aligns_to_its_own_block(kind: str) -> None:
    from hybrid.accounting import Setup, engine_config

    shape = HybridShape.from_config(QWEN3_NEXT_80B_A3B)
    with (
        as_if_cpu(kind),
        engine_config(shape, Setup(layer_ids=(2,), budget_bytes=BUDGET, platform="cpu")) as cfg,
    ):
        # the SSM state: conv 4 x 8192 bf16, recurrent 32 x 128 x 128 in float32 where the
        # CPU has AVX-512 BF16 (vLLM's accelerated GDN), else bf16
        state = 4 * 8192 * 2 + 32 * 128 * 128 * (4 if KINDS[kind] else 2)
        # the CPU platform starts from 128-token blocks: 128 * cdiv(state, 128 * 2048)
        block = 128 * cdiv(state, 128 * 2048)
        assert (state, block) == ((2_162_688, 1152) if KINDS[kind] else (1_114_112, 640))
        assert cfg.cache_config.block_size == block
        assert cfg.cache_config.mamba_page_size_padded == block * 2048
        assert cfg.cache_config.kv_cache_layout == "LBHNC"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cuda_figures_do_not_depend_on_the_cpu_the_report_runs_on(kind: str, tmp_path: Path) -> None:
    # vLLM's CPU platform turns the SSM state to float32 on AVX-512 BF16 when it checks
    # the config; a CUDA target keeps bf16, so its figures are the same from any host
    with as_if_cpu(kind):
        r = report(QWEN3_NEXT_80B_A3B, tmp_path, "--layers", "2,24,45,47", "--budget-gib", "20")
    assert r["setup"]["ssm_state_dtype"] == "auto"
    assert (r["ours"]["block_size"], r["ours"]["num_blocks"]) == (544, 963)
    assert r["setup"]["attention_block_size"] == 544 and "cuda" in r["setup"]["block_size_from"]


def test_the_target_block_size_can_be_given(tmp_path: Path) -> None:
    r = report(
        QWEN3_NEXT_80B_A3B, tmp_path, "--layers", "2,24,45,47", "--budget-gib", "20", "--block-size", "1088"
    )
    ours = r["ours"]
    assert r["setup"]["attention_block_size"] == ours["block_size"] == 1088
    assert r["setup"]["block_size_from"] == "given (1088)"
    groups = 12 * 1088 * 2048  # 12 layers' pages of 1088 tokens x 2048 bytes alias one pool block
    hidden = 1088 * 4 * 2048 * 2
    assert ours["bytes_per_block"] == groups + hidden
    assert ours["num_blocks"] == BUDGET // (groups + hidden)
    # a block too small for the state is raised to what the state needs, as vLLM does
    r = report(QWEN3_NEXT_80B_A3B, tmp_path, "--layers", "2", "--budget-gib", "20", "--block-size", "16")
    assert r["ours"]["block_size"] == 544


def test_qwen3_next_without_prefix_caching(tmp_path: Path) -> None:
    r = report(
        QWEN3_NEXT_80B_A3B, tmp_path, "--layers", "2,24,45,47", "--budget-gib", "20", "--no-prefix-caching"
    )
    ours, vllm = r["ours"], r["vllm"]
    assert r["setup"]["mamba_cache_mode"] == "none"
    # state groups keep one block per request (+1 speculative); their block is the max length
    assert [g["blocks_per_request"] for g in ours["groups"]] == [2, 2, 2, 61]
    assert ours["num_blocks"] == 963 and ours["token_capacity"] == int(963 / 67 * LEN) == 470_978
    # vLLM's hidden-state block divides gcd(32768, 544) = 32: 25.5x the bytes it needs
    hs = vllm["groups"][-1]
    assert hs["block_size"] == 32 and hs["blocks_per_request"] == LEN // 32
    assert vllm["hidden_state_bytes_per_block"] == 17 * 12 * 1_114_112
    assert vllm["hidden_state_bytes_per_block"] / vllm["hidden_state_bytes_needed_per_block"] == 25.5
    assert ours["token_capacity"] >= 9 * vllm["token_capacity"]
