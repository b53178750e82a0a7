"""The vLLM plugin that installs the supplementary-tensor design: ``register()``.

Declared as a ``vllm.general_plugins`` entry point of the package, so vLLM calls it
once in every process it starts (front end, engine core, workers). It wraps three
functions of vLLM 0.32.0, and nothing else:

1. ``vllm.v1.engine.core.get_kv_cache_configs`` -> ``hybrid.spec.plan_kv_cache_configs``
   (engine core: cache-only layers split out before grouping, exact budget);
2. ``vllm.v1.worker.gpu_model_runner.allocate_kv_cache`` -> ``runtime.with_supplementary_tensors``
   (workers, GPU and CPU runners: the supplementary tensors beside vLLM's);
3. ``ExtractHiddenStatesProposer.validate_same_kv_cache_group`` -> ``runtime.with_supplementary_group``
   (workers: the drafter writes with the attention group's slot mapping).

``HIDDEN_STATES_SUPPLEMENTARY``: unset or ``auto`` installs on vLLM 0.32.0 and, on any
other version, logs why it refuses and leaves vLLM untouched, and hands a model with no
full-attention group (Mamba-only) to vLLM's own grouping with one log line; ``1``
installs, raises on another version and refuses such a model; ``0`` turns it off.
``register()`` is idempotent and ``unregister()`` restores vLLM's functions.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vllm.hybrid.plugin")

ENV = "HIDDEN_STATES_SUPPLEMENTARY"
SUPPORTED_VLLM = "0.32.0"
ORIGINAL = "__hybrid_original__"


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not the version the patch points were written for."""


def _patch_points() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """(owner, attribute, wrapper factory) of every patch point."""
    from hybrid.runtime import with_supplementary_group, with_supplementary_tensors
    from hybrid.spec import plan_kv_cache_configs

    def plan(original: Any) -> Any:
        def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: Any, available_memory: Any) -> Any:
            announce()
            return plan_kv_cache_configs(
                vllm_config, kv_cache_specs, available_memory, original, fallback=mode() == "auto"
            )

        setattr(get_kv_cache_configs, ORIGINAL, original)
        return get_kv_cache_configs

    core = importlib.import_module("vllm.v1.engine.core")
    runner = importlib.import_module("vllm.v1.worker.gpu_model_runner")
    ehs = importlib.import_module("vllm.v1.spec_decode.extract_hidden_states")
    return [
        (core, "get_kv_cache_configs", plan),
        (runner, "allocate_kv_cache", with_supplementary_tensors),
        (ehs.ExtractHiddenStatesProposer, "validate_same_kv_cache_group", with_supplementary_group),
    ]


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "on"
    raise ValueError(f"{ENV}={value!r}: expected auto, 1 or 0")


def check_version(version: str) -> None:
    if version.split("+")[0] != SUPPORTED_VLLM:
        raise UnsupportedVLLMError(
            f"hybrid supplementary tensors are written for vLLM {SUPPORTED_VLLM}, found {version}: "
            f"vLLM is left unpatched (its own grouping of the cache-only layer applies). Set {ENV}=0 "
            "to silence this, or install a version of this package made for your vLLM."
        )


def installed() -> bool:
    """Whether every patch point currently holds our wrapper."""
    return all(hasattr(getattr(owner, name), ORIGINAL) for owner, name, _ in _patch_points())


def register() -> None:
    """Install the design into this process's vLLM (see the module docstring)."""
    m = mode()
    if m == "off":
        log.info("hybrid supplementary tensors: off (%s=0)", ENV)
        return
    import vllm

    try:
        check_version(vllm.__version__)
    except UnsupportedVLLMError as e:
        if m == "on":
            raise
        log.error("%s", e)
        return
    points = _patch_points()
    missing = [f"{getattr(o, '__name__', o)}.{n}" for o, n, _ in points if not callable(getattr(o, n, None))]
    if missing:
        raise UnsupportedVLLMError(f"vLLM {vllm.__version__} lacks the patch points {missing}")
    for owner, name, wrap in points:
        current = getattr(owner, name)
        if not hasattr(current, ORIGINAL):
            setattr(owner, name, wrap(current))
    announce()


_announced = False


def announce() -> None:
    """Log, once per process, that the design is active. vLLM configures its logging
    after it loads plugins in its first process, so until then this waits: every patched
    function calls it again."""
    global _announced
    if _announced or not logging.getLogger("vllm").handlers:
        return
    _announced = True
    log.info(
        "hybrid supplementary tensors active (vLLM %s): the cache-only layer of a hybrid or mixed-window "
        "model gets its own tensor, addressed by the full-attention group (%s=0 turns this off)",
        SUPPORTED_VLLM,
        ENV,
    )


def unregister() -> None:
    """Restore vLLM's own functions."""
    for owner, name, _ in _patch_points():
        current = getattr(owner, name)
        original = getattr(current, ORIGINAL, None)
        if original is not None:
            setattr(owner, name, original)
