"""The engine's configuration checked once, at startup, before the connector starts: a
bad one raises ``ConfigurationError`` (a ``ValueError``) naming the problem and its fix,
which vLLM prints as it fails.
A vLLM adapter (it reads vLLM's config objects); the options themselves are ``options``'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kv_connector.common.errors import ConfigurationError
from kv_connector.producer.options import EXAMPLE, ConnectorOptions, captured_layer_order

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def configured_layer_ids(vllm_config: VllmConfig) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` as the user listed them ([] when unset)."""
    spec = vllm_config.speculative_config
    hf_config = spec.draft_model_config.hf_config if spec and spec.draft_model_config else None
    return list(getattr(hf_config, "eagle_aux_hidden_state_layer_ids", []) or [])


def check_config(vllm_config: VllmConfig) -> tuple[ConnectorOptions, list[int]]:
    """Validate the engine's configuration; raise ValueError naming the problem and fix.

    Returns the options and the captured layer ids in the order of the states
    (``captured_layer_order``), which every sample reports, not the configured order."""
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    if ktc.kv_role != "kv_producer":
        raise ConfigurationError(
            f'HiddenStatesConnector is a producer: set "kv_role":"kv_producer" (got {ktc.kv_role!r}); '
            f"e.g. {EXAMPLE}"
        )
    options = ConnectorOptions.parse(ktc.kv_connector_extra_config)
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "extract_hidden_states":
        raise ConfigurationError(
            "HiddenStatesConnector needs vLLM's extract_hidden_states speculative method: add "
            '--speculative-config \'{"method":"extract_hidden_states","num_speculative_tokens":1,'
            '"draft_model_config":{"hf_config":{"eagle_aux_hidden_state_layer_ids":[...]}}}\''
        )
    assert spec.draft_model_config is not None
    configured = configured_layer_ids(vllm_config)
    if not configured:
        raise ConfigurationError(
            "extract_hidden_states needs eagle_aux_hidden_state_layer_ids in its hf_config"
        )
    layer_ids = captured_layer_order(configured)
    problem = pipeline_problem(vllm_config)
    if problem is not None:
        raise ConfigurationError(problem)
    problem = breakable_graph_problem(vllm_config)
    if problem is not None:
        raise ConfigurationError(problem)
    if getattr(vllm_config.model_config, "enable_sleep_mode", False) and not hasattr(
        KVConnectorBase_V1, "restore_kv_caches"
    ):
        raise ConfigurationError(
            "HiddenStatesConnector follows sleep mode from vLLM 0.33 on (this vLLM never tells a "
            "connector that the cache's memory is released and mapped again, so its NIXL "
            "registration would point at freed memory): upgrade vLLM, or drop --enable-sleep-mode"
        )
    return options, layer_ids


def pipeline_problem(vllm_config: VllmConfig) -> str | None:
    """Why this engine cannot ship hidden states under pipeline parallelism, or None.

    vLLM builds the extract_hidden_states drafter, and its cache-only layer, on the last
    stage only. Model Runner V2 carries the captured states of the earlier stages' layers
    to it (``relay_aux_hidden_states``) for models whose decoder declares it
    (``supports_aux_hidden_states_over_pp``: Llama, Qwen2 and their kin), and refuses the
    others by name itself. The V1 model runner carries none, and its earlier stages ask
    for the drafter they do not have as the cache is set up (vLLM 0.32 and 0.33)."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp <= 1 or vllm_config.use_v2_model_runner:
        return None
    return (
        f"HiddenStatesConnector under pipeline parallelism ({pp} stages) needs vLLM's Model "
        "Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, a GPU with Triton), which carries the captured "
        "states of every stage to the last, where the drafter writes them. The V1 model runner "
        "(the CPU build's, and a GPU's with V2 off) carries none across stages, and its "
        "earlier stages fail at start without the drafter vLLM builds on the last stage only "
        "(\"... object has no attribute 'drafter'\"). Use tensor parallelism "
        "with the V1 runner"
    )


def breakable_graph_problem(vllm_config: VllmConfig) -> str | None:
    """Why this engine cannot ship hidden states because its drafter would run inside a
    breakable CUDA graph, or None. vLLM's V1 model runner wraps the drafter in a
    ``BreakableCUDAGraphWrapper`` when ``VLLM_USE_BREAKABLE_CUDAGRAPH`` is on (vLLM turns
    it on by itself for the architectures in ``DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES``)
    and CUDA graphs are: a replay skips the cache-only layer's Python hook, so every
    request would fail with "wrote no slots". Model Runner V2 runs the extract_hidden_states
    drafter without a graph."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    from vllm.config.compilation import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    if not is_breakable_cudagraph_enabled() or mode is None or mode == CUDAGraphMode.NONE:
        return None
    if getattr(vllm_config.parallel_config, "use_ubatching", False) or vllm_config.use_v2_model_runner:
        return None
    model = vllm_config.model_config
    archs = ", ".join(model.architectures) if model is not None else "this model"
    return (
        f"HiddenStatesConnector cannot capture from {archs} with VLLM_USE_BREAKABLE_CUDAGRAPH on "
        "(vLLM turns it on by itself for some models: DeepSeek V3.2/V4, GLM-5, Kimi, MiniMax-M3) "
        "and CUDA graphs on the V1 model runner: the extract_hidden_states drafter is then replayed "
        "from a graph that skips the connector's hook, so no request's hidden states could be "
        "shipped. Set VLLM_USE_BREAKABLE_CUDAGRAPH=0 (vLLM's own opt-out), or run without CUDA "
        "graphs (--enforce-eager)."
    )
