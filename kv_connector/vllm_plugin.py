"""The vLLM plugin every process of a vLLM with this package runs first: ``register()``.

Declared as a ``vllm.general_plugins`` entry point, so vLLM calls it in its front end,
engine core and workers before any model runs (and before the front end builds the
engine's configuration). It does two things:

- asks for Intel AMX tile data on CPUs that have it (``kv_connector.common.amx``): vLLM's
  CPU attention runs AMX instructions without asking, and dies by SIGILL when nothing
  asked before it;
- lets the extract_hidden_states drafter start under pipeline parallelism
  (``lift_drafter_pipeline_refusal``): vLLM refuses any drafter whose class does not
  implement ``SupportsPP``, but this one is built on the last stage only and takes
  nothing from another stage. Whether the last stage holds every captured layer is the
  connector's check at its start (``producer.startup_checks``, ``producer.stages``).
"""

from __future__ import annotations

import logging
from typing import Any

from kv_connector.common.amx import request_amx

log = logging.getLogger("kv_connector.vllm_plugin")

DRAFTER = "ExtractHiddenStatesModel"
# set on our wrapper, so that a second register() wraps nothing again
LIFTED = "_kv_connector_drafter_pp"


def lift_drafter_pipeline_refusal() -> bool:
    """vLLM's ``ModelRegistry.is_pp_supported_model`` answers True for the drafter alone.

    ``ModelConfig.verify_with_parallel_config`` asks it for the draft model, whose
    parallel configuration is the target's (PP included), and raises "Pipeline parallelism
    is not supported for this model" otherwise. The drafter runs after the target's last
    stage, on that stage only (vLLM builds it ``if get_pp_group().is_last_rank``), so it
    needs none of what ``SupportsPP`` declares. Every other architecture is answered as
    before. False when this vLLM has no such method (nothing changed)."""
    try:
        from vllm.model_executor.models.registry import _ModelRegistry
    except ImportError:
        return False
    original = getattr(_ModelRegistry, "is_pp_supported_model", None)
    if original is None:
        return False
    if getattr(original, LIFTED, False):
        return True

    def is_pp_supported_model(self: Any, architectures: str | list[str], model_config: Any) -> bool:
        names = [architectures] if isinstance(architectures, str) else list(architectures)
        if names == [DRAFTER]:
            return True
        return bool(original(self, architectures, model_config))

    setattr(is_pp_supported_model, LIFTED, True)
    is_pp_supported_model.__wrapped__ = original  # type: ignore[attr-defined]
    _ModelRegistry.is_pp_supported_model = is_pp_supported_model  # type: ignore[method-assign]
    log.debug("the %s drafter may start under pipeline parallelism", DRAFTER)
    return True


def register() -> None:
    request_amx()
    lift_drafter_pipeline_refusal()
