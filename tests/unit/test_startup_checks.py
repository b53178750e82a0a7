"""Start-up checks, on vLLM's own VllmConfig (built by EngineArgs from a config-only model).

A model whose drafter vLLM would replay from a breakable CUDA graph is refused when the
connector starts, with why and what to set, instead of failing every request with "wrote
no slots"; CUDA graphs are set as a CUDA platform resolves them by default (the CPU build
turns them off), and the environment is read when the connector asks, as vLLM reads it.
Sleep mode is refused on a vLLM that does not tell connectors about it."""

from __future__ import annotations

from typing import Any

import pytest

from kv_connector.producer.startup_checks import check_config
from scripts.support.vllm_harness import config_only_model, engine_config

KTC = {
    "kv_connector": "HiddenStatesConnector",
    "kv_connector_module_path": "kv_connector.connector",
    "kv_role": "kv_producer",
    "kv_connector_extra_config": {"consumer_address": "127.0.0.1:1"},
}


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # the CPU build cannot build a V2 engine
        return engine_config(config_only_model(tmp_path_factory.mktemp("m"), 256), [1, 2], KTC)


def _with(cfg: Any, graphs: bool, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Any:
    from vllm.config.compilation import CUDAGraphMode

    mode = CUDAGraphMode.FULL_AND_PIECEWISE if graphs else CUDAGraphMode.NONE
    monkeypatch.setattr(cfg.compilation_config, "cudagraph_mode", mode)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return cfg


def test_breakable_graphs_on_v1_are_refused_at_start_up(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    with pytest.raises(ValueError) as e:
        check_config(_with(vllm_config, True, monkeypatch, env))
    why = str(e.value)
    assert "LlamaForCausalLM" in why and "skips the connector's hook" in why
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH=0" in why and "--enforce-eager" in why


@pytest.mark.parametrize(
    ("env", "graphs"),
    [
        ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}, True),  # the opt-out
        ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}, False),  # no graphs
        (
            {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"},
            True,
        ),  # V2: no drafter graph
    ],
)
def test_engines_that_run_the_hook_start(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], graphs: bool
) -> None:
    _, layer_ids = check_config(_with(vllm_config, graphs, monkeypatch, env))
    assert layer_ids == [1, 2]


def test_sleep_mode_on_a_vllm_without_the_sleep_hooks_is_refused(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32 frees and maps the cache again around sleep without telling connectors
    (0.33 calls unregister_kv_caches / restore_kv_caches): the NIXL registration would
    point at freed memory."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    monkeypatch.setattr(vllm_config.model_config, "enable_sleep_mode", True)
    if hasattr(KVConnectorBase_V1, "restore_kv_caches"):  # vLLM 0.33: it tells us
        check_config(vllm_config)
        monkeypatch.delattr(KVConnectorBase_V1, "restore_kv_caches")
    with pytest.raises(ValueError, match=r"sleep mode from vLLM 0\.33 on"):
        check_config(vllm_config)
    monkeypatch.setattr(vllm_config.model_config, "enable_sleep_mode", False)
    check_config(vllm_config)


def _pipeline_config(tmp_path: Any, layer_ids: list[int]) -> Any:
    """Two stages of a 4-layer Llama: layers 0-1, then 2-3."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # the CPU build cannot build a V2 engine
        return engine_config(config_only_model(tmp_path, 256), layer_ids, KTC, pp=2)


def test_vllm_refuses_the_drafter_under_pipeline_parallelism_unless_the_plugin_lifted_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own refusal, raised for the drafter (not the target) without our plugin's
    lift; with it (vLLM loads the plugin as it builds the config) the engine's config is made
    with two stages."""
    from vllm.model_executor.models.registry import ModelRegistry, _ModelRegistry

    from kv_connector.vllm_plugin import lift_drafter_pipeline_refusal

    assert lift_drafter_pipeline_refusal() and lift_drafter_pipeline_refusal()  # once, then a no-op
    lifted = _ModelRegistry.is_pp_supported_model
    assert lifted.__wrapped__ is not lifted and not hasattr(lifted.__wrapped__, "__wrapped__")
    cfg = _pipeline_config(tmp_path / "a", [3, 4])
    assert cfg.parallel_config.pipeline_parallel_size == 2
    assert cfg.speculative_config.draft_model_config.architectures == ["ExtractHiddenStatesModel"]
    # the target is asked as before: a Llama supports PP
    assert ModelRegistry.is_pp_supported_model(["LlamaForCausalLM"], cfg.model_config)
    monkeypatch.setattr(_ModelRegistry, "is_pp_supported_model", lifted.__wrapped__)
    monkeypatch.setattr("vllm.plugins.load_general_plugins", lambda: None)
    monkeypatch.setattr("vllm.engine.arg_utils.load_general_plugins", lambda: None, raising=False)
    with pytest.raises((NotImplementedError, ValueError), match="Pipeline parallelism is not supported"):
        _pipeline_config(tmp_path / "b", [3, 4])


@pytest.mark.parametrize("layer_ids", [[3, 4], [1, 2, 4]])
def test_pipeline_parallelism_needs_model_runner_v2(tmp_path: Any, layer_ids: list[int]) -> None:
    """Whatever layers are captured: the V1 runner is refused by name, V2 starts (it carries
    every stage's captured states to the last, or refuses the model by name itself)."""
    cfg = _pipeline_config(tmp_path, layer_ids)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
        with pytest.raises(ValueError) as e:
            check_config(cfg)
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        assert check_config(cfg)[1] == layer_ids
    why = str(e.value)
    assert "under pipeline parallelism (2 stages) needs vLLM's Model Runner V2" in why, why
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in why and "Use tensor parallelism with the V1 runner" in why
