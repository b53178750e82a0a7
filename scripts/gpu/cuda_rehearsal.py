"""What vLLM 0.33 builds for the engine tier on a capability-9.0 CUDA GPU (an H100),
rehearsed on a machine without one, in a Python that imports only the GPU host's packages
and the carry (``scripts.gpu.restricted_import``).

For each engine stage's own ``LLM`` arguments (``engine_tier.llm_kwargs``: ``eager``,
``engine``, ``pull``, ``hybrid``, ``hybrid_prefix``; a key vLLM's config classes do not
know, which ``LLM`` would drop, fails the stage) it builds vLLM's engine config on vLLM's own
``CudaPlatform``, then the target model and the drafter on the meta device, and reports
what vLLM chose: the compilation mode, CUDA-graph mode and post-grad passes, the attention
backend of every attention layer, the MoE backend, experts and router, the gated delta
net's prefill and decode kernels, the forward each custom op dispatches to and each
module's kernel tiers that are on. Nothing runs a kernel.

Then the ops that path refers to: read from the source of what was chosen (each module's
forward or the custom op's dispatched method, the MoE experts' and router's classes, the
attention implementation's class), through ``vllm._custom_ops`` and vLLM's own
``torch.ops.vllm`` ops one level down, each looked up in torch's op namespaces with the
carried stand-ins loaded: ``native`` (the stand-in computes it), ``named_only`` (it
raises when called), ``missing``. A ``missing`` or ``named_only`` op fails the rehearsal
unless ``OFF_PATH`` says why the tier's path never calls it. A reading of source: an op
called through a name this misses is not seen.

The GPU's own facts are the only stand-ins here: its capability, name and memory, the
device tensors are made on (meta), and CUDA streams and events (objects nothing uses
before a kernel runs). Triton is made to see the host as vLLM's workers do before their
device is set (``CUDA_VISIBLE_DEVICES`` empty), so vLLM uses the real Triton decorators::

    python -m scripts.gpu.cuda_rehearsal --carried DIR [--wheel NAME ...] --work DIR

It prints one JSON line: ``{"ok": ..., "stages": {stage: report}}``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import importlib
import importlib.util
import inspect
import json
import os
import socket
import sys
import textwrap
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

CAPABILITY = (9, 0)
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
DEVICE_MEMORY = 80 << 30
STAGES = ("eager", "engine", "pull", "hybrid", "hybrid_prefix")


def any_module(attribute: str) -> Callable[[Any, Any], bool]:
    """Taken where some module of the model has ``attribute`` set to True."""
    return lambda model, cfg: any(getattr(m, attribute, False) is True for m in model.modules())


def any_set(attribute: str) -> Callable[[Any, Any], bool]:
    """Taken where some module of the model has ``attribute`` other than None."""
    return lambda model, cfg: any(getattr(m, attribute, None) is not None for m in model.modules())


def never(model: Any, cfg: Any) -> bool:
    return False


def quantized(model: Any, cfg: Any) -> bool:
    return cfg.quant_config is not None


# ops the chosen code names on a branch the tier's path does not take: an op's name or an
# fnmatch pattern -> (why, whether the branch is taken for this model and config: then
# the op counts as on the path)
OFF_PATH: dict[str, tuple[str, Callable[[Any, Any], bool]]] = {
    "vllm.cpu_*": ("vLLM's CPU path", never),
    "vllm.*xpu*": ("vLLM's XPU path", never),
    "vllm.rocm_*": ("vLLM's ROCm path", never),
    "_C.*quant*": ("quantized weights or activations; the tier's models are not quantized", quantized),
    "vllm.*quantize*": ("quantized weights or activations; the tier's models are not quantized", quantized),
    "_C.fused_gdn_decode_post_conv_mtp": (
        "the fused GDN spec-decode kernel: a BF16 model with K=V=128 only",
        any_module("enable_fused_gdn_spec_decode"),
    ),
    "_C.vocab_parallel_embedding": (
        "the fused embedding gather: TP > 1 only",
        any_module("use_fused_embedding"),
    ),
    "_C.fp32_router_gemm": (
        "the router's fp32 GEMM: fp32 router weights of listed shapes, or ROCm gfx950",
        any_module("allow_fp32_router_gemm"),
    ),
    "_C.silu_and_mul_with_clamp": (
        "a SwiGLU clamp limit, which the tier's MoE has not",
        any_set("swiglu_limit"),
    ),
    "_moe_C.topk_sigmoid": (
        "the router's sigmoid scoring; Qwen3-Next's router scores by softmax",
        lambda model, cfg: any(getattr(m, "scoring_func", None) == "sigmoid" for m in model.modules()),
    ),
}


class NoDevice:
    """A CUDA stream or event where there is no GPU: made at construction, used only when
    a kernel runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def rehearse_platform() -> Any:
    """vLLM's own CUDA platform with this GPU's facts, made vLLM's current platform."""
    import torch
    import vllm.platforms as platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class RehearsedCudaPlatform(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:  # type: ignore[override]
            return DeviceCapability(*CAPABILITY)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return DEVICE_NAME

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return DEVICE_MEMORY

        @classmethod
        def is_fully_connected(cls, device_ids: list[int]) -> bool:
            return True

        @classmethod
        def current_device(cls) -> torch.device:
            return torch.device("meta")

    platform = RehearsedCudaPlatform()
    platforms.current_platform = platform
    torch.cuda.Stream = NoDevice  # type: ignore[misc, assignment]
    torch.cuda.Event = NoDevice  # type: ignore[misc, assignment]
    return platform


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_config(kwargs: dict[str, Any]) -> Any:
    """vLLM's engine config from ``LLM``'s arguments, as ``LLM`` builds it (the engine
    itself not started)."""
    from vllm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine

    got: dict[str, Any] = {}

    class Built(Exception):
        pass

    def capture(cls: type, engine_args: Any, *args: Any, **kw: Any) -> Any:
        got["args"] = engine_args
        raise Built

    saved = LLMEngine.__dict__["from_engine_args"]
    LLMEngine.from_engine_args = classmethod(capture)  # type: ignore[method-assign, assignment]
    try:
        LLM(**kwargs)
    except Built:
        pass
    finally:
        LLMEngine.from_engine_args = saved  # type: ignore[method-assign]
    return got["args"].create_engine_config()


def unknown_keys(kwargs: dict[str, Any]) -> list[str]:
    """The keys of the config dicts in ``kwargs`` that vLLM's config classes do not know
    (``LLM`` drops them without a word)."""
    from vllm.config import AttentionConfig, CompilationConfig, KernelConfig
    from vllm.config.utils import is_init_field

    classes = {"attention_config": AttentionConfig, "compilation_config": CompilationConfig}
    classes["kernel_config"] = KernelConfig
    return [
        f"{key}.{name}"
        for key, cls in classes.items()
        for name in kwargs.get(key, {})
        if not is_init_field(cls, name)
    ]


def config_report(cfg: Any) -> dict[str, Any]:
    comp = cfg.compilation_config
    passes = comp.pass_config
    spec = cfg.speculative_config
    transfer = cfg.kv_transfer_config
    return {
        "method": spec.method,
        "layer_ids": list(spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids),
        "connector": transfer.kv_connector,
        "connector_extra": transfer.kv_connector_extra_config,
        "eager": cfg.model_config.enforce_eager,
        "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
        "jit_warmup": cfg.kernel_config.enable_jit_warmup,
        "rms_norm_priority": list(cfg.kernel_config.ir_op_priority.rms_norm),
        "additional_config": cfg.additional_config,
        "compilation_mode": str(comp.mode),
        "cudagraph_mode": str(comp.cudagraph_mode),
        "capture_sizes": list(comp.cudagraph_capture_sizes or []),
        "custom_ops": list(comp.custom_ops),
        "passes_on": sorted(k for k, v in vars(passes).items() if v is True),
        "attention_backend": getattr(cfg.attention_config.backend, "name", None),
        "prefix_caching": cfg.cache_config.enable_prefix_caching,
        "mamba_cache_mode": str(cfg.cache_config.mamba_cache_mode),
        "async_scheduling": cfg.scheduler_config.async_scheduling,
        "model_runner_v2": bool(cfg.use_v2_model_runner),
        "dtype": str(cfg.model_config.dtype),
    }


def post_grad_passes(cfg: Any) -> list[str]:
    """The post-grad passes vLLM's compiler would run (their patterns registered: a pass
    that names an op no one defined fails here)."""
    from vllm.compilation.passes.pass_manager import PostGradPassManager

    manager = PostGradPassManager()
    manager.configure(cfg)
    return [type(p).__name__ for p in manager.passes]


@contextlib.contextmanager
def world_of_one(cfg: Any) -> Iterator[None]:
    """vLLM's process groups for one rank (gloo on loopback), for layers that ask them."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(cfg):
        parallel_state.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, "gloo")
        parallel_state.initialize_model_parallel(1, 1)  # an MoE model's config adds its EP group
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def build_on_meta(cfg: Any, model_config: Any = None) -> Any:
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model

    with torch.device("meta"):
        return initialize_model(cfg, model_config=model_config)


def qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


TIER_PREFIXES = ("allow_", "enable_", "use_")
TIER_SUFFIXES = ("_backend", "_kernel")


def module_choices(model: Any) -> dict[str, Any]:
    """What each kind of module chose: its dispatched forward, its kernel tiers that are
    on, and the attention, MoE and GDN backends."""
    dispatch: dict[str, str] = {}
    tiers: dict[str, list[str]] = {}
    attention: set[str] = set()
    moe: dict[str, Any] = {}
    gdn: dict[str, Any] = {}
    for _, module in model.named_modules():
        name = type(module).__name__
        method = getattr(module, "_forward_method", None)
        if method is not None:
            dispatch[name] = getattr(method, "__name__", str(method))
        on = sorted(
            f"{k}={v}" if isinstance(v, str) else k
            for k, v in vars(module).items()
            if (k.startswith(TIER_PREFIXES) and v is True)
            or (k.endswith(TIER_SUFFIXES) and isinstance(v, str))
        )
        if on:
            tiers[name] = on
        backend = getattr(module, "attn_backend", None)
        if backend is not None:
            attention.add(backend.get_name())
        quant = getattr(module, "quant_method", None)
        if quant is not None and hasattr(quant, "unquantized_backend"):
            moe["backend"] = str(getattr(quant.unquantized_backend, "value", quant.unquantized_backend))
            moe["experts"] = qualname(quant.experts_cls) if quant.experts_cls is not None else None
            moe["method_forward"] = getattr(getattr(quant, "_forward_method", None), "__name__", None)
        router = getattr(module, "router", None)
        if router is not None and "moe" in type(module).__module__:
            moe["router"] = qualname(router)
        if hasattr(module, "gdn_prefill_backend") and hasattr(module, "gdn_decode_kernel"):
            gdn = {
                "prefill": module.gdn_prefill_backend,
                "decode_kernel": module.gdn_decode_kernel,
                "fused_spec_decode": bool(getattr(module, "enable_fused_gdn_spec_decode", False)),
            }
    return {
        "attention": sorted(attention),
        "moe": moe or None,
        "gdn": gdn or None,
        "dispatch": dict(sorted(dispatch.items())),
        "tiers_on": dict(sorted(tiers.items())),
    }


# ---- the ops the chosen path refers to --------------------------------------------------


def op_references(source: str) -> tuple[set[tuple[str, str]], set[str], set[str]]:
    """``torch.ops.NS.NAME`` references, ``ops.NAME`` / ``_custom_ops.NAME`` calls (vLLM's
    ``from vllm import _custom_ops as ops``) and the plain names ``source`` reads."""
    tree = ast.parse(textwrap.dedent(source))
    namespaced: set[tuple[str, str]] = set()
    custom: set[str] = set()
    called: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            called.add(node.id)  # called, or handed on to be called (a dispatch's choice)
        if not isinstance(node, ast.Attribute):
            continue
        ns = node.value
        if (
            isinstance(ns, ast.Attribute)
            and isinstance(ns.value, ast.Attribute)
            and ns.value.attr == "ops"
            and isinstance(ns.value.value, ast.Name)
            and ns.value.value.id == "torch"
        ):
            namespaced.add((ns.attr, node.attr))
        elif isinstance(ns, ast.Name) and ns.id in ("ops", "_custom_ops"):
            custom.add(node.attr)
    return namespaced, custom, called


def source_of(obj: Any) -> str | None:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None


def path_sources(model: Any) -> dict[str, tuple[str, str]]:
    """The source of what the model's forward runs, by a name for the report: each
    module's dispatched method (a custom op) or ``forward``, a quant method's dispatched
    method, the MoE experts' and router's classes, the attention implementation's class.
    Values: (the module the code lives in, its source)."""
    found: dict[str, tuple[str, str]] = {}

    def add(key: str, obj: Any) -> None:
        func = getattr(obj, "__func__", obj)
        source = source_of(func)
        if source is not None and key not in found:
            found[key] = (getattr(func, "__module__", "") or "", source)

    for _, module in model.named_modules():
        cls = type(module)
        method = getattr(module, "_forward_method", None)
        if method is not None:
            add(f"{cls.__qualname__}.{method.__name__}", method)
        else:
            add(f"{cls.__qualname__}.forward", cls.forward)
        quant = getattr(module, "quant_method", None)
        if quant is not None:
            quant_method = getattr(quant, "_forward_method", None) or getattr(quant, "apply", None)
            if quant_method is not None:
                add(f"{type(quant).__qualname__}.{quant_method.__name__}", quant_method)
            experts = getattr(quant, "experts_cls", None)
            if isinstance(experts, type):
                add(experts.__qualname__, experts)
        router = getattr(module, "router", None)
        if router is not None:
            add(type(router).__qualname__, type(router))
        backend = getattr(module, "attn_backend", None)
        if backend is not None:
            impl = backend.get_impl_cls()
            add(impl.__qualname__, impl)
    return found


def vllm_op_source(module_name: str, op: str) -> str | None:
    """The Python behind ``torch.ops.vllm.<op>``: vLLM registers ``<op>`` or ``<op>_impl``
    of the module that calls it."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    for name in (op, f"{op}_impl"):
        fn = getattr(module, name, None)
        if callable(fn):
            return source_of(fn)
    return None


FOLLOW_DEPTH = 3  # plain calls followed into vLLM's functions, this many deep


def referenced_ops(model: Any) -> dict[str, list[str]]:
    """Every ``NS.NAME`` op the path's source refers to, with where: through
    ``vllm._custom_ops``, vLLM's own ``torch.ops.vllm`` ops and the vLLM functions the
    path calls by plain name (``FOLLOW_DEPTH`` deep)."""
    custom_ops = importlib.import_module("vllm._custom_ops")
    where: dict[str, set[str]] = {}
    seen: set[Any] = set()

    def follow(key: str, module_name: str, name: str, depth: int) -> None:
        module = sys.modules.get(module_name)
        fn = getattr(module, name, None) if module is not None else None
        owner = getattr(fn, "__module__", None) or ""
        if not inspect.isfunction(fn) or not owner.startswith("vllm.") or fn in seen:
            return
        seen.add(fn)
        source = source_of(fn)
        if source is not None:
            scan(f"{key} -> {name}", owner, source, depth + 1)

    def scan(key: str, module_name: str, source: str, depth: int) -> None:
        namespaced, custom, called = op_references(source)
        for name in custom:
            fn = getattr(custom_ops, name, None)
            inner = source_of(fn) if callable(fn) else None
            if inner is None:
                where.setdefault(f"_custom_ops.{name}", set()).add(key)
                continue
            for ns, op in op_references(inner)[0]:
                where.setdefault(f"{ns}.{op}", set()).add(f"{key} -> ops.{name}")
        for ns, op in namespaced:
            where.setdefault(f"{ns}.{op}", set()).add(key)
            if ns == "vllm" and depth < FOLLOW_DEPTH:
                inner = vllm_op_source(module_name, op)
                if inner is not None:
                    scan(f"{key} -> vllm.{op}", module_name, inner, depth + 1)
        if depth < FOLLOW_DEPTH:
            for name in called:
                follow(key, module_name, name, depth)

    for key, (module_name, source) in path_sources(model).items():
        scan(key, module_name, source, 0)
    return {op: sorted(places) for op, places in sorted(where.items())}


def op_state(op: str) -> str:
    """``native``, ``named_only`` (a stand-in that raises when called) or ``missing``."""
    import torch

    ns, _, name = op.partition(".")
    if ns == "_custom_ops":
        return "missing"
    if not hasattr(getattr(torch.ops, ns), name):
        return "missing"
    named_only: set[str] = set()
    for module_name in ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"):
        module = sys.modules.get(module_name)
        named_only |= set(getattr(module, "NAMED_ONLY", ()))
    return "named_only" if ns == "_C" and name in named_only else "native"


def off_path(op: str, model: Any, cfg: Any) -> str | None:
    """Why ``OFF_PATH`` says the branch that calls ``op`` is not taken here, or None."""
    for pattern, (why, taken) in OFF_PATH.items():
        if fnmatch.fnmatchcase(op, pattern) and not taken(model, cfg):
            return why
    return None


def ops_report(model: Any, cfg: Any) -> dict[str, Any]:
    refs = referenced_ops(model)
    states = {op: op_state(op) for op in refs}
    skipped = {op: off_path(op, model, cfg) for op, state in states.items() if state != "native"}
    unmet = {op: {"state": states[op], "from": refs[op]} for op, why in skipped.items() if why is None}
    return {"ops": states, "unmet": unmet, "off_path": {op: why for op, why in skipped.items() if why}}


# a backend's name -> the package it runs on
BACKEND_PACKAGES = {"flashinfer": "flashinfer", "cutedsl": "cutlass", "flash_attn": "vllm.vllm_flash_attn"}


def missing_packages(report: dict[str, Any]) -> dict[str, Any]:
    """The packages the chosen backends run on that this Python cannot import (on the GPU
    host: not installed, not carried), as unmet entries."""
    chosen = {
        "attention": report.get("attention") or [],
        "moe": list((report.get("moe") or {}).values()),
        "gdn": list((report.get("gdn") or {}).values()),
    }
    unmet: dict[str, Any] = {}
    for where, values in chosen.items():
        for value in values:
            for backend, package in BACKEND_PACKAGES.items():
                if backend in str(value).lower() and importlib.util.find_spec(package) is None:
                    entry = unmet.setdefault(f"package {package}", {"state": "missing", "from": []})
                    entry["from"].append(f"{where}: {value}")
    return unmet


# ---- the stages -----------------------------------------------------------------------


def stage_kwargs(stage: str, models: dict[str, Path]) -> tuple[dict[str, Any], dict[str, str]]:
    """``LLM``'s arguments and the environment the engine tier gives a stage."""
    from scripts.gpu import engine_tier as et

    case = et.HYBRID if stage.startswith("hybrid") else et.DENSE
    pull = stage == "pull"
    address = None if pull else "127.0.0.1:1"
    kwargs = et.llm_kwargs(
        str(models[case.family]), address, stage == "eager", pull, case, stage == "hybrid_prefix"
    )
    env = {"HIDDEN_STATES_SUPPLEMENTARY": "1", "VLLM_MOE_SKIP_PADDING": "0"} if case is et.HYBRID else {}
    return kwargs, env


def attempt(report: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None with its error in ``report[key]`` and the stage failed."""
    try:
        return fn()
    except Exception as e:
        report[key] = {"error": f"{type(e).__name__}: {e}"[-1500:], "where": traceback.format_exc()[-1500:]}
        report["ok"] = False
        return None


def rehearse_stage(stage: str, models: dict[str, Path]) -> dict[str, Any]:
    kwargs, env = stage_kwargs(stage, models)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return rehearse_config(kwargs, env)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def rehearse_config(kwargs: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One stage: its config, its model and drafter on the meta device, the ops on their path."""
    report: dict[str, Any] = {"ok": True, "env": env, "unknown_keys": unknown_keys(kwargs)}
    report["ok"] = not report["unknown_keys"]
    cfg = attempt(report, "engine_config", lambda: engine_config(kwargs))
    if cfg is None:
        return report
    report["config"] = config_report(cfg)
    if not kwargs.get("enforce_eager"):
        passes = attempt(report, "post_grad_passes", lambda: post_grad_passes(cfg))
        if passes is not None:
            report["post_grad_passes"] = passes
    with world_of_one(cfg):
        model = attempt(report, "model", lambda: build_on_meta(cfg))
        if model is not None:
            report["model"] = type(model).__name__
            report.update(module_choices(model))
            ops = attempt(report, "ops", lambda: ops_report(model, cfg))
            if ops is not None:
                report.update(ops)
                report["unmet"].update(missing_packages(report))
                report["ok"] = report["ok"] and not report["unmet"]
        drafter_config = cfg.speculative_config.draft_model_config
        drafter = attempt(report, "drafter", lambda: build_on_meta(cfg, drafter_config))
        if drafter is not None:
            report["drafter"] = {"model": type(drafter).__name__, **module_choices(drafter)}
            ops = attempt(report, "drafter_ops", lambda: ops_report(drafter, cfg))
            if ops is not None:
                report["drafter"].update(ops)
                report["ok"] = report["ok"] and not ops["unmet"]
    return report


def rehearse(stages: Sequence[str], work: Path) -> dict[str, Any]:
    from scripts.gpu import engine_tier as et
    from scripts.support.make_tiny_model import build_tiny_model

    platform = rehearse_platform()
    models = {
        case.family: build_tiny_model(work / f"tiny-{case.family}", case.family, seed=0, dtype=case.dtype)
        for case in (et.DENSE, et.HYBRID)
    }
    out: dict[str, Any] = {
        "platform": {
            "class": qualname(platform),
            "is_cuda": platform.is_cuda(),
            "capability": list(CAPABILITY),
            "device": DEVICE_NAME,
        },
        "stages": {},
    }
    for stage in stages:
        out["stages"][stage] = rehearse_stage(stage, models)
    out["ok"] = all(s["ok"] for s in out["stages"].values())
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--carried", action="append", type=Path, default=[], help="a carried folder, on sys.path")
    ap.add_argument("--wheel", action="append", default=[], help="a distribution the carry brings as a wheel")
    ap.add_argument("--work", type=Path, required=True, help="a folder for the tiny models")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"some of {', '.join(STAGES)}")
    args = ap.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        ap.error(f"unknown stage {unknown[0]!r} (stages: {', '.join(STAGES)})")
    # before vLLM is imported: the CUDA platform, and Triton as a worker sees it
    os.environ["VLLM_TARGET_DEVICE"] = "cuda"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("VLLM_CACHE_ROOT", str(args.work / "vllm-cache"))
    from scripts.gpu import restricted_import

    for folder in reversed(args.carried):
        sys.path.insert(0, str(folder))
    restricted_import.install(args.carried, args.wheel)
    out = rehearse(stages, args.work)
    print(json.dumps(out), flush=True)
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
