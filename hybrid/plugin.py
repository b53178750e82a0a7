"""The vLLM plugin that installs the supplementary-tensor design: ``register()``.

Declared as a ``vllm.general_plugins`` entry point of the package, so vLLM calls it
once in every process it starts (front end, engine core, workers). It wraps these
functions of vLLM 0.32.0 and 0.33.0 (one code base; ``hybrid.versions`` has what
differs), and nothing else:

1. ``vllm.v1.engine.core.get_kv_cache_configs`` -> ``hybrid.spec.plan_kv_cache_configs``
   (engine core: cache-only layers split out before grouping, exact budget);
1b. 0.33 only: ``vllm.v1.engine.core.get_global_kv_cache_groups`` ->
   ``hybrid.spec.plan_kv_cache_groups`` (0.33 groups before it sizes: the cache-only
   layers join no group);
2. ``vllm.v1.worker.gpu_model_runner.allocate_kv_cache`` and
   ``vllm.v1.worker.gpu.attn_utils.allocate_kv_cache`` -> ``runtime.with_supplementary_tensors``
   (workers, Model Runner V1 (GPU and CPU) and V2: the supplementary tensors beside vLLM's);
3. ``ExtractHiddenStatesProposer.validate_same_kv_cache_group`` (V1) ->
   ``runtime.with_supplementary_group`` and ``ExtractHiddenStatesSpeculator.propose`` (V2)
   -> ``runtime.with_supplementary_slots`` (workers: the drafter writes with the
   attention group's slot mapping).

``HIDDEN_STATES_SUPPLEMENTARY``: unset or ``auto`` installs on the supported versions;
on any other it installs nothing but a watcher of the engine core's
``get_kv_cache_configs`` that, for a hybrid model only, logs once that it refuses and
names the supported versions (dense models: nothing above DEBUG); a model without a
full-attention layer (Mamba-only) is handed to vLLM's own grouping with one log line.
``1`` installs, raises on another version and refuses such a model; ``0`` turns it off.
``register()`` is idempotent and ``unregister()`` restores vLLM's functions.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from hybrid.notice import ENV, OncePerProcess, announce
from hybrid.versions import SUPPORTED_VLLM, is_supported, supported_text
from kv_connector.common.errors import ConfigurationError

log = logging.getLogger("vllm.hybrid.plugin")

ORIGINAL = "__hybrid_original__"
__all__ = ["SUPPORTED_VLLM", "register", "unregister"]


class UnsupportedVLLMError(ConfigurationError, RuntimeError):
    """The installed vLLM is not a version the patch points were written for, or a
    combination of its features the design cannot serve."""


Point = tuple[Any, str, Callable[[Any], Any]]


def _plan(original: Any) -> Any:
    from hybrid.spec import SupplementedKVCacheConfig, plan_kv_cache_configs

    def get_kv_cache_configs(
        vllm_config: Any, kv_cache_specs: Any, available_memory: Any, global_kv_cache_groups: Any = None
    ) -> Any:
        announce()
        configs = plan_kv_cache_configs(
            vllm_config,
            kv_cache_specs,
            available_memory,
            original,
            global_kv_cache_groups,
            fallback=mode() == "auto",
        )
        if any(isinstance(c, SupplementedKVCacheConfig) for c in configs):
            check_combination(vllm_config)
        return configs

    setattr(get_kv_cache_configs, ORIGINAL, original)
    return get_kv_cache_configs


def _group(original: Any) -> Any:
    from hybrid.spec import plan_kv_cache_groups

    def get_global_kv_cache_groups(vllm_config: Any, kv_cache_specs: Any) -> Any:
        return plan_kv_cache_groups(vllm_config, kv_cache_specs, original, fallback=mode() == "auto")

    setattr(get_global_kv_cache_groups, ORIGINAL, original)
    return get_global_kv_cache_groups


def _v2_points() -> list[Point]:
    """Model Runner V2's patch points; [] where its modules do not import."""
    from hybrid.runtime import with_supplementary_slots, with_supplementary_tensors

    try:
        attn = importlib.import_module("vllm.v1.worker.gpu.attn_utils")
        ehs = importlib.import_module("vllm.v1.worker.gpu.spec_decode.extract_hidden_states")
    except ImportError as e:
        log.debug("Model Runner V2 not importable here (%s): its patch points are left out", e)
        return []
    return [
        (attn, "allocate_kv_cache", with_supplementary_tensors),
        (ehs.ExtractHiddenStatesSpeculator, "propose", with_supplementary_slots),
    ]


def _patch_points() -> list[Point]:
    """(owner, attribute, wrapper factory) of every patch point of this vLLM."""
    from hybrid.runtime import with_supplementary_group, with_supplementary_tensors

    core = importlib.import_module("vllm.v1.engine.core")
    runner = importlib.import_module("vllm.v1.worker.gpu_model_runner")
    ehs = importlib.import_module("vllm.v1.spec_decode.extract_hidden_states")
    points: list[Point] = [(core, "get_kv_cache_configs", _plan)]
    # 0.33: the engine core groups first
    if hasattr(core, "get_global_kv_cache_groups"):
        points.append((core, "get_global_kv_cache_groups", _group))
    points += [
        (runner, "allocate_kv_cache", with_supplementary_tensors),
        (ehs.ExtractHiddenStatesProposer, "validate_same_kv_cache_group", with_supplementary_group),
    ]
    return points + _v2_points()


def v2_installed() -> bool:
    """Whether Model Runner V2's patch points hold our wrappers in this process."""
    points = _v2_points()
    return bool(points) and all(hasattr(getattr(o, n), ORIGINAL) for o, n, _ in points)


def check_combination(vllm_config: Any) -> None:
    """Refuse, at planning (engine start), what the design cannot serve, with the fix:
    Model Runner V2 without its patch points, and HiSparse (which allocates the KV cache
    itself)."""
    if getattr(vllm_config.attention_config, "hisparse_config", None) is not None:
        raise UnsupportedVLLMError(
            "hybrid supplementary tensors: HiSparse allocates the KV cache itself, so the hidden-state "
            f"tensor would not be allocated; set {ENV}=0 to use vLLM's own grouping"
        )
    if getattr(vllm_config, "use_v2_model_runner", False) and not v2_installed():
        raise UnsupportedVLLMError(
            "hybrid supplementary tensors: vLLM runs Model Runner V2 here and its patch points "
            "(vllm.v1.worker.gpu.attn_utils.allocate_kv_cache, ExtractHiddenStatesSpeculator.propose) "
            "are not installed in this process; set VLLM_USE_V2_MODEL_RUNNER=0 (Model Runner V1 is "
            f"supported), or install vLLM {supported_text('or')}"
        )


def mode() -> str:
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "on"
    raise ConfigurationError(f"{ENV}={value!r}: expected auto, 1 or 0")


def refusal(version: str) -> str:
    return (
        f"hybrid supplementary tensors are written for vLLM {supported_text()}, found {version}: "
        "refused, vLLM is left unpatched (its own grouping of the cache-only layer applies, "
        "which bills every hidden-state block a whole page of the pool). "
        f"Install vLLM {supported_text('or')}, or set {ENV}=0 to silence this."
    )


def check_version(version: str) -> None:
    if not is_supported(version):
        raise UnsupportedVLLMError(refusal(version))


def installed() -> bool:
    """Whether every patch point currently holds our wrapper."""
    return all(hasattr(getattr(owner, name), ORIGINAL) for owner, name, _ in _patch_points())


# the line refusing a hybrid model on another vLLM
REFUSAL_LOGGED = OncePerProcess()


def _refusal_watcher(original: Any) -> Any:
    """On a version the design is not written for: vLLM's ``get_kv_cache_configs``
    unchanged (any signature), logging the refusal once if the model is hybrid."""

    def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: Any, *args: Any, **kwargs: Any) -> Any:
        if not REFUSAL_LOGGED.said:
            try:
                from hybrid.spec import supplemented

                hybrid = supplemented(kv_cache_specs) is not None
            # another vLLM's classes: say nothing rather than break it
            except Exception as e:
                log.debug("hybrid supplementary tensors: cannot read this vLLM's specs (%s)", e)
                hybrid = False
            if hybrid and REFUSAL_LOGGED.first():
                import vllm

                log.error("%s", refusal(vllm.__version__))
        return original(vllm_config, kv_cache_specs, *args, **kwargs)

    setattr(get_kv_cache_configs, ORIGINAL, original)
    return get_kv_cache_configs


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
        log.debug("%s", e)
        try:
            core = importlib.import_module("vllm.v1.engine.core")
        except ImportError:
            return
        current = getattr(core, "get_kv_cache_configs", None)
        if callable(current) and not hasattr(current, ORIGINAL):
            setattr(core, "get_kv_cache_configs", _refusal_watcher(current))  # noqa: B010
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


def unregister() -> None:
    """Restore vLLM's functions (the watcher of an unsupported version included)."""
    owners: list[tuple[Any, str]] = []
    with contextlib.suppress(ImportError):
        owners = [(o, n) for o, n, _ in _patch_points()]
    with contextlib.suppress(ImportError):
        owners.append((importlib.import_module("vllm.v1.engine.core"), "get_kv_cache_configs"))
    for owner, name in owners:
        current = getattr(owner, name, None)
        original = getattr(current, ORIGINAL, None)
        if original is not None:
            setattr(owner, name, original)
