"""A misconfigured producer fails at startup with a message that names the fix.

``check_config`` is run on real VllmConfig objects built by vLLM's own EngineArgs (no
engine started; this works on CPU as is), and once through a real ``vllm.LLM`` in a
subprocess, where the message must reach the user on stderr."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.e2e.conftest import run_producer
from tests.engines import EngineSpec, Run

if TYPE_CHECKING:
    from vllm.config import VllmConfig

pytestmark = [pytest.mark.e2e]

LAYER_IDS = [1, 2, 4]
ADDRESS = "127.0.0.1:1"  # never contacted: these producers fail before connecting
SPECULATIVE = {
    "method": "extract_hidden_states",
    "num_speculative_tokens": 1,
    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS}},
}
_DEFAULT: Any = object()


def engine_config(
    model: Path,
    *,
    kv_role: str = "kv_producer",
    extra: dict[str, Any] | None = None,
    speculative: dict[str, Any] | None = _DEFAULT,
) -> VllmConfig:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_bytes=128 << 20,
        enforce_eager=True,
        speculative_config=SPECULATIVE if speculative is _DEFAULT else speculative,
        kv_transfer_config={  # vLLM validates the dict into a KVTransferConfig
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"consumer_address": ADDRESS} if extra is None else extra,
        },
    ).create_engine_config()


def check_error(config: VllmConfig) -> str:
    from kv_connector.producer.startup_checks import check_config

    with pytest.raises(ValueError) as info:
        check_config(config)
    return str(info.value)


def test_good_config_gives_the_options_and_the_layer_ids(tiny_llama: Path) -> None:
    from kv_connector.producer.startup_checks import check_config

    config = engine_config(tiny_llama)
    assert config.kv_transfer_config is not None and config.kv_transfer_config.kv_role == "kv_producer"
    options, layer_ids = check_config(config)
    assert layer_ids == LAYER_IDS
    assert options.push.readers == (ADDRESS,)
    assert options.include_output_tokens is False


def speculative_with(layer_ids: list[int]) -> dict[str, Any]:
    hf_config = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    return {**SPECULATIVE, "draft_model_config": {"hf_config": hf_config}}


def test_unsorted_layer_ids_are_reported_in_the_order_vllm_captures_them(tiny_llama: Path) -> None:
    from kv_connector.producer.startup_checks import check_config

    _, layer_ids = check_config(engine_config(tiny_llama, speculative=speculative_with([3, 1, 2])))
    assert layer_ids == [1, 2, 3]


def test_duplicate_layer_ids_are_rejected_naming_the_duplicate(tiny_llama: Path) -> None:
    msg = check_error(engine_config(tiny_llama, speculative=speculative_with([2, 1, 2])))
    assert "eagle_aux_hidden_state_layer_ids lists layer 2 more than once ([2, 1, 2])" in msg
    assert "list each layer once, e.g. [1, 2]" in msg


def test_consumer_role_is_rejected_naming_kv_producer(tiny_llama: Path) -> None:
    msg = check_error(engine_config(tiny_llama, kv_role="kv_consumer"))
    assert '"kv_role":"kv_producer"' in msg
    assert "'kv_consumer'" in msg


def test_missing_consumer_address_is_named(tiny_llama: Path) -> None:
    msg = check_error(engine_config(tiny_llama, extra={}))
    assert "kv_connector_extra_config.consumer_address" in msg


def test_missing_speculative_config_names_extract_hidden_states(tiny_llama: Path) -> None:
    config = engine_config(tiny_llama, speculative=None)
    assert config.speculative_config is None
    msg = check_error(config)
    assert "extract_hidden_states" in msg and "--speculative-config" in msg


@pytest.mark.fresh_engine("vLLM failing to start")
def test_vllm_fails_to_start_as_a_kv_consumer_and_says_why(tiny_llama: Path) -> None:
    spec = EngineSpec.of(tiny_llama, LAYER_IDS, block_size=None, kv_role="kv_consumer", max_model_len=1024)
    result = run_producer(spec, Run([[1, 2, 3]]), ADDRESS, timeout=300)
    assert result["rc"] != 0
    assert "outputs" not in result, "generate() ran although the connector was misconfigured"
    stderr = result["stderr"]
    assert "HiddenStatesConnector is a producer" in stderr, stderr[-3000:]
    assert '"kv_role":"kv_producer"' in stderr and "'kv_consumer'" in stderr


@pytest.mark.fresh_engine("vLLM failing to start")
def test_vllm_with_duplicate_layer_ids_fails_to_start_and_says_why(tiny_llama: Path) -> None:
    """Without the check vLLM starts, then fails at its first step with a tensor-shape
    error that names neither the layer ids nor the fix."""
    spec = EngineSpec.of(tiny_llama, [1, 2, 2], block_size=None, max_model_len=1024)
    result = run_producer(spec, Run([[1, 2, 3]]), ADDRESS, timeout=300)
    assert result["rc"] != 0
    assert "outputs" not in result, "generate() ran although the layer ids name a layer twice"
    assert "lists layer 2 more than once" in result["stderr"], result["stderr"][-3000:]


@pytest.mark.fresh_engine("vLLM failing to start")
def test_two_pipeline_stages_on_the_v1_runner_fail_to_start_naming_model_runner_v2(tiny_llama: Path) -> None:
    """vLLM's own refusal of the drafter under PP is lifted by our plugin (``vllm_plugin``);
    the CPU build's V1 runner, which carries no captured states across stages and asks
    every stage for the drafter built on the last, is then refused by our check in the
    workers, by name, before vLLM fails on the first stage's missing drafter."""
    spec = EngineSpec.of(
        tiny_llama, [3, 4], block_size=None, max_model_len=1024, pp=2,
        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    )  # fmt: skip
    result = run_producer(spec, Run([[1, 2, 3]]), ADDRESS, timeout=300)
    assert result["rc"] != 0 and "outputs" not in result
    log = result["log"]
    assert "under pipeline parallelism (2 stages) needs vLLM's Model Runner V2" in log, log[-3000:]
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in log and "no attribute 'drafter'" in log  # (quoted by ours)
    assert "Pipeline parallelism is not supported for this model" not in log  # vLLM's, lifted
    assert "AttributeError" not in log  # refused before the first stage looked for the drafter
