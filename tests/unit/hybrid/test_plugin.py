"""The plugin's installation into vLLM 0.32 and 0.33 (patch points, idempotence, the
switch, the version refusal) and the worker-side pieces it installs, on vLLM's real
functions: the supplementary tensor next to vLLM's own allocation, and the drafter's
group."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from hybrid import plugin
from hybrid.host import cpu_ssm_state_is_float32
from hybrid.shapes import HybridShape
from scripts.support.make_tiny_model import TINY_QWEN3_NEXT

pytestmark = pytest.mark.slow


def targets() -> dict[str, Any]:
    import vllm.v1.engine.core as core
    import vllm.v1.worker.gpu.attn_utils as v2_attn
    import vllm.v1.worker.gpu_model_runner as runner
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    from vllm.v1.worker.gpu.spec_decode.extract_hidden_states import ExtractHiddenStatesSpeculator

    found = {
        # the names as the engine core and the model runners look them up
        "get_kv_cache_configs": vars(core)["get_kv_cache_configs"],
        "allocate_kv_cache": vars(runner)["allocate_kv_cache"],
        "validate_same_kv_cache_group": ExtractHiddenStatesProposer.validate_same_kv_cache_group,
        "v2 allocate_kv_cache": vars(v2_attn)["allocate_kv_cache"],
        "v2 propose": ExtractHiddenStatesSpeculator.propose,
    }
    if "get_global_kv_cache_groups" in vars(core):  # 0.33: the engine core groups first
        found["get_global_kv_cache_groups"] = vars(core)["get_global_kv_cache_groups"]
    return found


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.unregister()
    before = targets()
    yield before
    plugin.unregister()
    assert targets() == before


def test_register_wraps_every_patch_point_once(clean: dict[str, Any]) -> None:
    import vllm

    plugin.register()
    first = targets()
    assert plugin.installed() and plugin.v2_installed()
    for name, fn in first.items():
        assert getattr(fn, plugin.ORIGINAL) is clean[name], name
    assert ("get_global_kv_cache_groups" in first) == vllm.__version__.startswith("0.33")
    plugin.register()  # re-entrant: vLLM loads plugins again in every process
    assert targets() == first
    plugin.unregister()
    assert targets() == clean and not plugin.installed()


def test_switched_off_by_the_environment(clean: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ENV, "0")
    plugin.register()
    assert targets() == clean


def test_bad_switch_value_is_an_error(clean: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ENV, "maybe")
    with pytest.raises(ValueError, match=plugin.ENV):
        plugin.register()


def test_another_vllm_version_is_refused_for_hybrid_models_only(
    clean: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tiny: tuple[Any, Any, dict[str, Any]],
) -> None:
    import vllm
    import vllm.v1.engine.core as core

    cfg, _, specs = tiny
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    plugin.REFUSAL_LOGGED.reset()

    def ours() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name.startswith("vllm.hybrid") and r.levelno > logging.DEBUG]

    with caplog.at_level(logging.DEBUG, logger="vllm.hybrid"):
        plugin.register()
        assert not plugin.installed()
        assert not ours()  # nothing at start: dense or not
        dense = {n: s for n, s in specs.items() if "linear_attn" not in n}
        core.get_kv_cache_configs(cfg, [dense], [32 << 20], *_groups(cfg, [dense]))
        assert not ours()  # a dense model never hears of it
        for _ in range(2):
            (config,) = core.get_kv_cache_configs(cfg, [specs], [32 << 20], *_groups(cfg, [specs]))
    assert "cache_only_layers.8" in {n for g in config.kv_cache_groups for n in g.layer_names}  # vLLM's own
    (record,) = ours()  # once
    assert record.levelno == logging.ERROR
    assert "written for vLLM 0.32.0 and 0.33.0, found 0.34.0: refused" in record.getMessage()
    assert "Install vLLM 0.32.0 or 0.33.0" in record.getMessage()
    plugin.unregister()
    monkeypatch.setenv(plugin.ENV, "1")
    with pytest.raises(plugin.UnsupportedVLLMError, match=r"0\.34\.0"):
        plugin.register()
    assert targets() == clean
    monkeypatch.setattr(vllm, "__version__", "0.32.0+cpu")
    plugin.register()
    assert plugin.installed()


def _groups(cfg: Any, specs: list[dict[str, Any]]) -> list[Any]:
    """The engine core's extra argument on 0.33 (its groups), none on 0.32."""
    from hybrid import versions

    return [versions.kv_cache_groups(cfg, specs)] if versions.groups_before_configs() else []


def tiny_cpu_block() -> int:
    """The tiny model's attention block on this host's CPU platform, by hand: its GDN
    state is conv (kernel 4 - 1 + 1 speculative) x conv_dim (128 * 1 * 2 + 128 * 2 = 512)
    bf16 plus recurrent 2 x 128 x 128 (float32 where the CPU has AVX-512 BF16, else
    bf16); one attention token is K and V x 2 kv heads x head dim 64 x bf16 = 512 bytes;
    the CPU platform starts from 128-token blocks."""
    state = 4 * 512 * 2 + 2 * 128 * 128 * (4 if cpu_ssm_state_is_float32() else 2)
    return 128 * -(-state // (128 * 512))  # 256 with a bf16 state, 384 with float32


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """The e2e test's tiny Qwen3-Next: vLLM's config, its KV cache planned by the design
    at 32 MiB, and its layers' specs."""
    from hybrid.accounting import Setup, engine_config, layer_specs
    from hybrid.spec import plan_kv_cache_configs

    shape = HybridShape.from_config(
        {**TINY_QWEN3_NEXT, "architectures": ["Qwen3NextForCausalLM"], "torch_dtype": "bfloat16"}
    )
    setup = Setup(
        layer_ids=(1, 4, 8), budget_bytes=32 << 20, max_model_len=2048, platform="cpu", prefix_caching=False
    )
    with engine_config(shape, setup) as cfg:
        specs = layer_specs(cfg, shape, "cpu")
        (config,) = plan_kv_cache_configs(cfg, [dict(specs)], [setup.budget_bytes])
        yield cfg, config, specs


def test_supplementary_tensor_is_allocated_beside_vllms(tiny: tuple[Any, Any, dict[str, Any]]) -> None:
    import torch
    from vllm.model_executor.models.extract_hidden_states import basic_cache
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybrid.runtime import with_supplementary_tensors
    from kv_connector.wire.layout import layout_from_view

    cfg, config, _ = tiny
    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    plain = allocate_kv_cache(config, torch.device("cpu"), layout, sizes)
    caches = with_supplementary_tensors(allocate_kv_cache)(config, torch.device("cpu"), layout, sizes)
    name = "cache_only_layers.8"
    assert set(caches) == set(plain) | {name}
    bs, n = config.kv_cache_groups[config.supplementary_group].kv_cache_spec.block_size, config.num_blocks
    assert bs == tiny_cpu_block() and config.supplementary_group == 3
    hs = caches[name]
    assert tuple(hs.shape) == (n, 3, bs, 128) and hs.dtype == torch.bfloat16
    assert layout_from_view(hs.shape, hs.stride(), 3, 128)[:2] == ("LTH", bs)
    assert hs.untyped_storage().nbytes() == n * bs * 3 * 128 * 2
    # vLLM's own cache write at slot b * bs + o lands in block b, position o
    slots = torch.tensor([2 * bs + 5, 7 * bs + bs - 1])
    states = torch.randn(2, 3, 128).to(torch.bfloat16)
    basic_cache(states, hs, slots)
    assert torch.equal(hs[2, :, 5], states[0]) and torch.equal(hs[7, :, bs - 1], states[1])
    assert int((hs != 0).sum()) == int((states != 0).sum())  # and nothing else


def test_split_kernel_blocks_are_refused(tiny: tuple[Any, Any, dict[str, Any]]) -> None:
    import torch

    from hybrid.runtime import allocate_supplementary

    cfg, config, _ = tiny
    sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    sizes[config.supplementary_group] //= 2
    with pytest.raises(ValueError, match="kernel blocks"):
        allocate_supplementary(
            config, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout(), sizes
        )


def test_drafter_takes_the_supplementary_group(tiny: tuple[Any, Any, dict[str, Any]]) -> None:
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    from hybrid.runtime import with_supplementary_group

    _, config, _ = tiny
    validate = with_supplementary_group(ExtractHiddenStatesProposer.validate_same_kv_cache_group)
    drafter = SimpleNamespace(attn_layer_names=["cache_only_layers.8"], kv_cache_gid=-1)
    validate(drafter, config)
    assert drafter.kv_cache_gid == 3
    # a layer that is neither supplementary nor in a group: vLLM's own check still refuses
    stranger = SimpleNamespace(attn_layer_names=["cache_only_layers.9"], kv_cache_gid=-1)
    with pytest.raises(ValueError, match="not in any KV cache group"):
        validate(stranger, config)


@pytest.mark.parametrize(("switch", "falls_back"), [("auto", True), ("", True), ("1", False)])
def test_the_switch_decides_what_a_model_without_attention_group_gets(
    clean: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    tiny: tuple[Any, Any, dict[str, Any]],
    switch: str,
    falls_back: bool,
) -> None:
    """The engine core's patched planner: auto mode hands a state-only model to vLLM's
    own grouping; the design forced on refuses it by name."""
    import vllm.v1.engine.core as core

    from hybrid.spec import NoAttentionGroupError, SupplementedKVCacheConfig

    cfg, _, specs = tiny
    state_only = {n: s for n, s in specs.items() if "self_attn" not in n}
    monkeypatch.setenv(plugin.ENV, switch)
    plugin.register()
    planner = vars(core)["get_kv_cache_configs"]
    if not falls_back:
        with pytest.raises(NoAttentionGroupError, match="has none"):
            planner(cfg, [dict(state_only)], [32 << 20], *_groups(cfg, [state_only]))
        return
    (config,) = planner(cfg, [dict(state_only)], [32 << 20], *_groups(cfg, [state_only]))
    (theirs,) = clean["get_kv_cache_configs"](
        cfg, [dict(state_only)], [32 << 20], *_groups(cfg, [state_only])
    )
    assert not isinstance(config, SupplementedKVCacheConfig)
    assert config.num_blocks == theirs.num_blocks
    assert [g.layer_names for g in config.kv_cache_groups] == [g.layer_names for g in theirs.kv_cache_groups]
