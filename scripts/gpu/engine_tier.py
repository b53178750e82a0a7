"""The GPU check's engine tier: vLLM 0.33.0's own Python code, carried to a GPU host with
no package index (``scripts.gpu.engine_carry``), running our producer end to end:

    python -m scripts.gpu_check --tier engine [--only import,engine,...] [--plan]

It unpacks the carry (``.gpu-carry/engine``) into a temporary folder, installs its wheels
there (pip without an index, unzip where pip refuses), puts vLLM's tree with the
stand-in for its compiled kernels (``scripts.gpu.stand_in_kernels``), NIXL and the wheels
first on ``PYTHONPATH``, and runs stages, each in a process of its own with a time limit,
each ``{"ok": ..., figures, "log_tail": ...}`` in the one JSON line printed at the end
(also written to ``$OUT/engine.json`` when ``OUT`` is set):

  import    ``import vllm``: its version, platform, the attention backends that import,
            the stand-ins' ops (a UVA view and a weak alias checked on the GPU), a Triton
            kernel, our connector and NIXL
  eager     a tiny random Llama (fp32) in ``LLM`` with ``enforce_eager=True``,
            TRITON_ATTN, ``custom_ops: ["none"]``, ``extract_hidden_states`` (layers 1, 2,
            4) and our connector pushing into a ``HiddenStatesReader`` host pool in the
            engine's parent process; every sample against transformers'
            ``output_hidden_states`` on the same GPU; the host syncs inside our worker
            hooks (``host_syncs``, from ``KV_CONNECTOR_SYNC_CHECK``'s log lines). First:
            the shortest way to a sample, and it compiles the Triton kernels ``engine``
            reuses
  engine    the same with torch.compile and CUDA graphs (Model Runner V2 and async
            scheduling as vLLM defaults; which runner ran is read from vLLM's log and from
            the samples' provenance), its start cut where nothing tested is lost: the KV
            cache's size given (no throwaway capture in memory profiling), no JIT warm-up
            of every kernel variant, graphs for batch sizes 1-16 only
  v1        the same on the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``), run when
            ``engine`` failed and time is left (Model Runner V2, or vLLM itself?)
  hybrid    the same on a tiny random hybrid Qwen3-Next (bf16; layers 1, 4, 8) with the
            hybrid plugin on (``HIDDEN_STATES_SUPPLEMENTARY=1``) and prefix caching off:
            its gated delta net is vLLM's Triton kernels (prefill too:
            ``gdn_prefill_backend="triton"``), its MoE the ``_moe_C`` stand-in's ops, its
            cache-only layer our supplementary tensor
  hybrid_prefix  the same with prefix caching on (``mamba_cache_mode="align"``, vLLM's
            default on a GPU), run when ``hybrid`` passed
  gpu_pool  the dense model into a reader pool on the GPU (``pool_device="cuda:0"``), run
            when ``engine`` passed and time is left
  pull      ``"delivery": "pull"``: each sample fetched by its handle with ``PullClient``,
            run when ``engine`` passed and time is left
  speed     ``a_over_a0`` on the GPU: the Llama's prefill tokens/s with our connector (every
            sample taken by a reader) over the same engine's without a connector, two
            engines alive at once, new prompts each round, in alternating pairs

A call runs its stages within ``--total-s`` (``TOTAL_S`` by default); ``PLAN`` is the GPU host's calls
(docs/usage.md, "GPU check"): ``import,eager,engine,v1``, then ``hybrid,hybrid_prefix``,
then ``gpu_pool,pull,speed``.

Our package's vLLM plugins (``pyproject.toml``'s ``vllm.general_plugins``) are declared in
the unpacked carry, so vLLM loads them in every process as it would from an installed
package. Without CUDA it refuses at once, with the reason. Its runs on an H200 have not yet got a
sample out of vLLM (docs/benchmarks.md, "GPU runs").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from scripts.support.stopping import ends_with_parent

REPO = Path(__file__).resolve().parents[2]
CARRY = REPO / ".gpu-carry" / "engine"
VLLM_TAR = "vllm-0.33.0-py.tar.xz"
NIXL_TAR = "nixl-cu13-1.5.1-ucx.tar.xz"
STAND_IN = Path(__file__).resolve().parent / "stand_in_kernels.py"
# stage -> its time limit on a GPU, seconds, in the order they run: eager first (the
# shortest way to a first sample, and it leaves the Triton kernels compiled for engine),
# the hybrid model after the dense one (its Triton kernels autotune about 100
# configurations cold: a call of its own), prefix caching on only after a first hybrid
# sample with it off
LIMITS_S = {
    "import": 120, "eager": 240, "engine": 300, "v1": 240, "hybrid": 480, "hybrid_prefix": 300,
    "gpu_pool": 200, "pull": 200, "speed": 300,
}  # fmt: skip
STAGES = list(LIMITS_S)
TOTAL_S = 540  # one call's stages together: under a 10-minute command with the set-up (7 s)
MIN_STAGE_S = 90  # an optional stage starts only with this much of the call's time left
# the GPU host's calls, in order (docs/usage.md, "GPU check"), each with its own --total-s:
# a wrong guess costs one call, not the whole time
# (stages, --total-s): the first two fit a 15-minute lease with the machine's start; the
# third runs when those two ended early or on a later lease
PLAN: tuple[tuple[tuple[str, ...], int], ...] = (
    (("import", "eager", "engine", "v1"), 400),
    (("hybrid", "hybrid_prefix"), 330),
    (("gpu_pool", "pull", "speed"), 330),
)
OPTIONAL = ("v1", "hybrid", "hybrid_prefix", "gpu_pool", "pull", "speed")  # run only with MIN_STAGE_S left
TAIL = 3000
PROMPT_LENGTHS = [1, 7, 129, 300]
MAX_MODEL_LEN = 1024


@dataclass(frozen=True)
class ModelCase:
    """A tiny model a stage builds and checks: its family (``make_tiny_model``), the dtype vLLM
    runs it in, the layers captured (the layer count itself: the last layer's output, before
    the final norm) and the relative error allowed against transformers in fp32."""

    family: str
    dtype: str
    layer_ids: tuple[int, ...]
    tolerance: float


DENSE = ModelCase("llama", "float32", (1, 2, 4), 1e-2)  # fp32 both sides: TF32 or reduction order apart
HYBRID = ModelCase("qwen3_next", "bfloat16", (1, 4, 8), 5e-2)  # bf16 in vLLM against fp32
# set (to "1") by --no-async-scheduling for the stages' processes
NO_ASYNC_SCHEDULING = "ENGINE_TIER_NO_ASYNC_SCHEDULING"
# "cpu": the engine stages' own code rehearsed on vLLM's CPU build (its defaults, eager, the
# reference on the host): a check of this module, saying nothing of a GPU
REHEARSAL = os.environ.get("ENGINE_TIER_REHEARSAL") == "cpu"
REF_DEVICE = "cpu" if REHEARSAL else "cuda"
# log lines worth keeping whole (the runner, backends, graphs, compilation, failures)
LOG_KEYS = re.compile(
    r"Model Runner|model runner|backend|cudagraph|CUDA graph|Capturing|torch.compile|Compil|"
    r"_C\.|_C_stable|Error|ERROR|Traceback|reader|stand-in|Triton|triton|supplementary|host sync"
)
SYNC_LINE = re.compile(r"host sync inside the connector's (\w+) \((\d+) so far\)")
SYNC_COUNTING = "counting host syncs inside the connector's hooks"
LOG_NOISE = re.compile(r"Processed prompts|Rendering prompts|Loading weights|LD_PRELOAD|non-default args")


def refuse_without_cuda() -> None:
    """Exit at once with one line, unless this Python sees a CUDA GPU."""
    try:
        import torch
    except ImportError:
        raise SystemExit("gpu_check --tier engine needs torch with CUDA; this Python has no torch") from None
    if not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check --tier engine needs a CUDA GPU: torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}); the carried vLLM runs only on one "
            '(docs/usage.md, "GPU check")'
        )


def carry_missing(carry: Path) -> list[str]:
    """What of the carry is not in ``carry``."""
    missing = [n for n in (VLLM_TAR, NIXL_TAR) if not (carry / n).is_file()]
    if not list((carry / "wheels").glob("*.whl")):
        missing.append("wheels/*.whl")
    return missing


# ------------------------------------------------------------------------- set-up
def unpack_tar(archive: Path, dest: Path) -> int:
    """``archive`` (tar.xz) into ``dest``; the number of files."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        for m in members:
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                raise ValueError(f"{archive.name}: unsafe member {m.name!r}")
        tar.extractall(dest, members)
    return sum(1 for m in members if m.isfile())


def install_wheels(wheels: list[Path], dest: Path) -> dict[str, Any]:
    """The wheels into ``dest`` with pip (no index, no dependencies); unzipped where pip
    refuses (their ``.data`` parts left out)."""
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    pip += ["--disable-pip-version-check", "--target", str(dest)]
    proc = subprocess.run([*pip, *map(str, wheels)], capture_output=True, text=True)
    if proc.returncode == 0:
        return {"how": "pip", "wheels": len(wheels)}
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(dest, [n for n in z.namelist() if not n.split("/", 1)[0].endswith(".data")])
    return {"how": "unzip", "wheels": len(wheels), "pip_error": proc.stderr.strip()[-600:]}


def set_up(carry: Path, work: Path) -> tuple[list[Path], dict[str, Any]]:
    """The carry unpacked under ``work``: the folders to put first on the path, and what
    was done (files, seconds)."""
    t0 = time.monotonic()
    tree, nixl, site = work / "vllm", work / "nixl", work / "site"
    report: dict[str, Any] = {"vllm_files": unpack_tar(carry / VLLM_TAR, tree)}
    # the stand-in kept in the repository wins over the one packed in the carry
    shutil.copyfile(STAND_IN, tree / "vllm" / "_C_stable_libtorch.py")
    report["nixl_files"] = unpack_tar(carry / NIXL_TAR, nixl)
    report["wheels"] = install_wheels(sorted((carry / "wheels").glob("*.whl")), site)
    report["plugins"] = declare_plugins(site)
    report["seconds"] = round(time.monotonic() - t0, 1)
    return [site, tree, nixl], report


def declare_plugins(site: Path) -> list[str]:
    """Our package's ``vllm.general_plugins`` entry points, as ``pyproject.toml`` names them,
    in a dist-info under ``site``: the repository travels as a folder, not installed, and vLLM
    finds plugins only by entry point. The names declared."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins: dict[str, str] = project.get("entry-points", {}).get("vllm.general_plugins", {})
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = "".join(f"{k} = {v}\n" for k, v in plugins.items())
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{lines}")
    return sorted(plugins)


def stage_env(path: list[Path]) -> dict[str, str]:
    env = {**os.environ}
    parts = [*map(str, path), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # UCX may touch CUDA before vLLM forks
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    # Model Runner V2's sampler imports flashinfer (not on the host) unless told not to
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("VLLM_TARGET_DEVICE", None)
    return env


# ---------------------------------------------------------------------- the parent
def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """The stage's process group (vLLM's engine core and workers with it)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def key_lines(log: str, limit: int = 40) -> list[str]:
    """The log lines that say what vLLM chose or what failed, shortened."""
    lines = [ln.strip()[:300] for ln in log.splitlines() if LOG_KEYS.search(ln) and not LOG_NOISE.search(ln)]
    return lines[-limit:]


def runner_from_log(log: str) -> str | None:
    """Which model runner vLLM said it used."""
    if "Using V2 Model Runner" in log:
        return "v2"
    if "using the V1 model runner instead" in log or "Model Runner V2 does not yet support" in log:
        return "v1"
    return None


def spawn_stage(name: str, work: Path, env: dict[str, str], limit_s: float) -> dict[str, Any]:
    """``--stage name`` in a new process group with a time limit: its result, the tail of
    its output (vLLM's log) and the log lines that say what vLLM chose."""
    result_file = work / f"{name}.result.json"
    log_file = log_dir(work) / f"{name}.log"  # under $OUT as it is written: a killed run keeps it
    cmd = [sys.executable, "-m", "scripts.gpu.engine_tier", "--stage", name, "--work", str(work)]
    cmd += ["--result", str(result_file)]
    t0 = time.monotonic()
    with log_file.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=ends_with_parent(),  # not left holding the GPU if the check dies
        )
        timed_out = False
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
            rc = proc.wait()
        finally:
            kill_group(proc)  # what it left running (an engine core holding the GPU), stopped or not
    seconds = round(time.monotonic() - t0, 1)
    text = log_file.read_text(errors="replace")
    out: dict[str, Any]
    try:
        out = json.loads(result_file.read_text())
    except (OSError, ValueError):
        why = f"did not finish within {limit_s:.0f} s" if timed_out else f"exited {rc} without a result"
        out = {"ok": False, "error": why}
        with contextlib.suppress(OSError, ValueError):
            out["partial"] = json.loads(result_file.with_suffix(".partial.json").read_text())
    if timed_out and out.get("ok"):
        out["ok"] = False
    out["seconds"] = seconds
    out["exit_code"] = rc
    if name != "import":
        out["runner_from_log"] = runner_from_log(text)
        out["host_syncs"] = syncs_from_log(text)
    out["log_lines"] = key_lines(text)
    out["log_tail"] = text[-TAIL:]
    return out


def syncs_from_log(log: str) -> dict[str, Any]:
    """The host syncs the connector counted inside its hooks (``KV_CONNECTOR_SYNC_CHECK``):
    whether it counted, and the most each hook reached (no hook: none seen)."""
    hooks: dict[str, int] = {}
    for hook, n in SYNC_LINE.findall(log):
        hooks[hook] = max(hooks.get(hook, 0), int(n))
    return {"counted": SYNC_COUNTING in log, "in_hooks": hooks}


def versions() -> dict[str, Any]:
    import torch

    return {
        "tier": "engine",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
    }


def run(names: list[str], carry: Path, keep: bool, total_s: float = TOTAL_S) -> dict[str, Any]:
    """Set up the carry, then the stages in order, each as far as the time allows."""
    refuse_without_cuda()
    missing = carry_missing(carry)
    if missing:
        raise SystemExit(
            f"gpu_check --tier engine: the carry at {carry} lacks {', '.join(missing)}; build it on a "
            "machine with the package index: python -m scripts.gpu_check --tier engine --plan"
        )
    t0 = time.monotonic()
    result = versions()
    work = Path(tempfile.mkdtemp(prefix="engine-tier-"))
    result["work"] = str(work)
    try:
        path, result["set_up"] = set_up(carry, work)
    except Exception as e:
        result["set_up"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-TAIL:]}
        result["ok"] = False
        return result
    env = stage_env(path)
    done: dict[str, dict[str, Any]] = {}
    for name in names:
        left = total_s - (time.monotonic() - t0)
        why = skip_reason(name, done, left)
        if why:
            done[name] = {"ok": None, "skipped": why}
        else:
            done[name] = spawn_stage(name, work, env, min(LIMITS_S[name], max(left, 10)))
        result[name] = done[name]
        print(f"gpu_check engine: {name}: {status(done[name])}", file=sys.stderr, flush=True)
        write_out({**result, "partial": True})  # what ran so far, should the whole command be killed
    ran = [n for n in names if not done[n].get("skipped")]
    # v1 only says why engine failed: the tier passes when every other stage that ran did
    result["ok"] = bool(ran) and all(done[n].get("ok") for n in ran if n != "v1")
    result["seconds"] = round(time.monotonic() - t0, 1)
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def status(out: dict[str, Any]) -> str:
    """One line of a stage's outcome: ok with its runner and error, skipped, or the last
    line of its error."""
    if out.get("skipped"):
        return f"skipped ({out['skipped']})"
    comparison = out.get("comparison") or out.get("partial", {}).get("comparison") or {}
    syncs = out.get("host_syncs") or {}
    facts = (
        f"runner {out.get('runner_from_log')}, worst relative error {comparison.get('worst_relative_error')}"
        + (f", host syncs in our hooks {syncs.get('in_hooks')}" if syncs.get("counted") else "")
    )
    if out.get("ok"):
        return f"ok in {out.get('seconds')} s ({facts})"
    last = str(out.get("error", "")).strip().splitlines()[-1:] or ["?"]
    return f"FAILED in {out.get('seconds')} s ({facts}): {last[0][:300]}"


def write_out(result: dict[str, Any]) -> None:
    """``result`` as one JSON line in ``$OUT/engine.json`` when ``OUT`` is set."""
    out = os.environ.get("OUT")
    if out:
        try:
            Path(out, "engine.json").write_text(json.dumps(result) + "\n")
        except OSError as e:
            print(f"gpu_check engine: cannot write {out}/engine.json: {e}", file=sys.stderr)


def log_dir(work: Path) -> Path:
    """Where stages write their logs: ``$OUT/engine-logs`` when ``OUT`` is set (so what a
    stage logged comes back even when the whole command is killed), else ``work``."""
    out = os.environ.get("OUT")
    if out:
        with contextlib.suppress(OSError):
            dest = Path(out, "engine-logs")
            dest.mkdir(parents=True, exist_ok=True)
            return dest
    return work


def skip_reason(name: str, done: dict[str, dict[str, Any]], left: float) -> str | None:
    """Why stage ``name`` does not run now, or None."""
    imp = done.get("import")
    if name != "import" and imp is not None and not imp.get("vllm_version"):
        return "import vllm failed"
    engine = done.get("engine")
    if name == "v1" and engine is not None and engine.get("ok"):
        return "engine passed (v1 runs only to tell Model Runner V2 from vLLM when it fails)"
    if name in ("gpu_pool", "pull", "speed") and engine is not None and not engine.get("ok"):
        return "engine failed"
    hybrid = done.get("hybrid")
    if name == "hybrid_prefix" and hybrid is not None and not hybrid.get("ok"):
        return "hybrid failed (prefix caching on comes after a first hybrid sample with it off)"
    if name in OPTIONAL and left < MIN_STAGE_S:
        return f"only {left:.0f} s of the call's time left"
    if left < 10:
        return f"only {left:.0f} s of the call's time left"
    return None


def plan(carry: Path) -> dict[str, Any]:
    """The carry (built where missing) and the repository as they travel, file by file,
    against the 64 MiB a GPU host accepts."""
    from scripts.gpu import carry as device_carry
    from scripts.gpu import engine_carry

    if carry_missing(carry) or not engine_carry.wheels_complete(carry / "wheels"):
        engine_carry.build(carry)
    files = {
        p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else str(p): p.stat().st_size
        for p in sorted(carry.rglob("*"))
        if p.is_file()
    }
    tree = sum(p.stat().st_size for p in device_carry.travelling_files(REPO))
    total = tree + sum(files.values())
    limit = device_carry.LIMIT_BYTES
    return {
        "carry": files,
        "carry_MiB": round(sum(files.values()) / (1 << 20), 2),
        "repository_MiB": round(tree / (1 << 20), 2),
        "total_MiB": round(total / (1 << 20), 2),
        "limit_MiB": limit >> 20,
        "fits": total <= limit,
        "device_tool_carry": [
            carry.relative_to(REPO).as_posix() if carry.is_relative_to(REPO) else str(carry)
        ],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.gpu_check --tier engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--carry", type=Path, default=CARRY, help="the carried folder (default .gpu-carry/engine)"
    )
    ap.add_argument("--only", default=",".join(STAGES), help="comma-separated stages to run, in order")
    ap.add_argument(
        "--total-s", type=float, default=TOTAL_S, help=f"the stages' time together (default {TOTAL_S})"
    )
    ap.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="the engines without async scheduling (Model Runner V2's default): tells its failure apart",
    )
    ap.add_argument("--plan", action="store_true", help="build the carry where missing and print its measure")
    ap.add_argument("--keep", action="store_true", help="keep the unpacked carry and the stages' logs")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stage:  # a child: one stage, its result in --result
        child(args.stage, args.work, args.result)
    if args.plan:
        print(json.dumps(plan(args.carry)), flush=True)
        return
    if args.total_s <= 0:
        raise SystemExit(f"--total-s must be positive, not {args.total_s:g}")
    if args.no_async_scheduling:
        os.environ[NO_ASYNC_SCHEDULING] = "1"  # the stages' processes inherit it
    names = [n for n in args.only.split(",") if n]
    for n in names:
        if n not in STAGES:
            raise SystemExit(f"unknown stage {n!r}; the stages are {', '.join(STAGES)}")
    result = run(names, args.carry, args.keep, args.total_s)
    write_out(result)
    print(json.dumps(result), flush=True)
    if not result.get("ok"):
        sys.exit(1)


# ----------------------------------------------------------------------- the child
def child(name: str, work: Path, result_file: Path) -> NoReturn:
    """Stage ``name`` in this process; its result (or its traceback) in ``result_file``.
    Ends the process at once afterwards: vLLM's and NIXL's threads are not waited for."""
    global PARTIAL_FILE
    PARTIAL_FILE = result_file.with_suffix(".partial.json")
    stages: dict[str, Callable[[Path], dict[str, Any]]] = {
        "import": stage_import,
        "eager": lambda w: stage_engine(w, eager=True),
        "engine": lambda w: stage_engine(w, eager=False),
        "v1": lambda w: stage_engine(w, eager=False, v1=True),
        "hybrid": lambda w: stage_engine(w, eager=False, case=HYBRID),
        "hybrid_prefix": lambda w: stage_engine(w, eager=False, case=HYBRID, prefix_caching=True),
        "gpu_pool": lambda w: stage_engine(w, eager=False, pool_device="cuda:0"),
        "pull": lambda w: stage_engine(w, eager=False, pull=True),
        "speed": stage_speed,
    }
    try:
        out: dict[str, Any] = {"ok": True, **stages[name](work)}
    except BaseException as e:  # the stage's own report: what it got to, then why it stopped
        partial = getattr(e, "partial", {})
        out = {"ok": False, **partial, "error": traceback.format_exc()[-TAIL:]}
    text = json.dumps(out, default=str)
    result_file.write_text(text)
    print(f"engine tier stage {name}: {'ok' if out.get('ok') else 'failed'}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


PARTIAL_FILE: Path | None = None


def checkpoint(report: dict[str, Any]) -> None:
    """What a stage found so far, where its parent reads it if the stage never finishes."""
    if PARTIAL_FILE is not None:
        with contextlib.suppress(OSError, TypeError, ValueError):
            PARTIAL_FILE.write_text(json.dumps(report, default=str))


def attempt(report: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, its value in ``report[key]``, or its error there; never raises."""
    try:
        value = fn()
    except Exception as e:
        report[key] = {"error": f"{type(e).__name__}: {e}"[-800:]}
        return None
    report[key] = value
    return value


def triton_smoke() -> dict[str, Any]:
    """A Triton kernel compiled and run on the GPU (Model Runner V2 and TRITON_ATTN need it)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator,misc]
    def add(x, y, out, n, block: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * block + tl.arange(0, block)
        mask = offs < n
        tl.store(out + offs, tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)

    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    add[(4,)](x, x, out, 1000, block=256)
    return {"triton": triton.__version__, "exact": bool(torch.equal(out, 2 * x))}


def stand_in_checks() -> dict[str, Any]:
    """The stand-in's ops as vLLM uses them: a UVA view written by the GPU and read on the
    host, a weak alias of a CUDA tensor (each checked on its own)."""
    import torch
    import vllm._C_stable_libtorch as stand_in  # type: ignore[import-not-found]

    def uva() -> dict[str, Any]:
        host = torch.zeros(64, dtype=torch.int32, pin_memory=True)
        view = torch.ops._C.get_cuda_view_from_cpu_tensor(host)
        view.add_(torch.arange(64, device="cuda", dtype=torch.int32))
        torch.cuda.synchronize()
        expect = torch.arange(64, dtype=torch.int32)
        return {"device": str(view.device), "host_sees_gpu_writes": bool(torch.equal(host, expect))}

    def weak_ref() -> dict[str, Any]:
        x = torch.arange(256, device="cuda", dtype=torch.bfloat16).view(16, 16)[:, :8]
        weak = torch.ops._C.weak_ref_tensor(x)
        return {
            "same_memory": weak.data_ptr() == x.data_ptr(),
            "equal": bool(torch.equal(weak, x)),
            "strides": list(weak.stride()) == list(x.stride()),
        }

    report: dict[str, Any] = {"defined": stand_in.DEFINED, "failed": stand_in.FAILED}
    attempt(report, "uva_view", uva)
    attempt(report, "weak_ref", weak_ref)
    report["fallbacks"] = stand_in.FALLBACKS
    attempt(report, "moe", moe_stand_in_check)
    return report


def moe_stand_in_check() -> dict[str, Any]:
    """The ``_moe_C`` stand-in's ops (router top-k, block alignment, the top-k sum) as the
    fused-MoE layer calls them, captured in a CUDA graph and replayed on new logits: the
    replay must equal the same calls run eagerly, which it cannot if an op syncs with the
    host (capture fails) or baked a value of its inputs into the graph."""
    import torch
    import vllm._moe_C_stable_libtorch as moe  # type: ignore[import-not-found]

    tokens, experts, k, block, width = 8, 8, 2, 4, 16
    cuda = torch.device("cuda")
    logits = torch.randn(tokens, experts, device=cuda)
    weights = torch.empty(tokens, k, device=cuda)
    ids = torch.empty(tokens, k, dtype=torch.int32, device=cuda)
    sources = torch.empty_like(ids)
    cap = tokens * k + experts * (block - 1)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=cuda)
    block_experts = torch.empty((cap + block - 1) // block, dtype=torch.int32, device=cuda)
    padded = torch.empty(1, dtype=torch.int32, device=cuda)
    expert_out = torch.randn(tokens, k, width, device=cuda)
    summed = torch.empty(tokens, width, device=cuda)
    ops = torch.ops._moe_C

    def step() -> None:
        ops.topk_softmax(weights, ids, sources, logits, True, None, None)
        ops.moe_align_block_size(ids, experts, block, sorted_ids, block_experts, padded, None, None)
        ops.moe_sum(expert_out, summed, ids, None)

    outputs = (weights, ids, sorted_ids, block_experts, padded, summed)
    step()  # warm up outside the capture, as vLLM does
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    logits.copy_(torch.randn(tokens, experts, device=cuda))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in outputs]
    step()
    torch.cuda.synchronize()
    return {
        "defined": moe.DEFINED,
        "failed": moe.FAILED,
        "replay_equals_eager": all(torch.equal(a, b) for a, b in zip(replayed, outputs, strict=True)),
    }


def attention_backends() -> dict[str, str]:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    out: dict[str, str] = {}
    for name in ("TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION"):
        try:
            AttentionBackendEnum[name].get_class()
            out[name] = "imports"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"[:300]
    return out


def stage_import(work: Path) -> dict[str, Any]:
    import sysconfig

    import torch

    report: dict[str, Any] = {
        "c_compiler": next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None),
        "python_h": Path(sysconfig.get_paths()["include"], "Python.h").is_file(),
    }
    attempt(
        report, "device", lambda: [torch.cuda.get_device_name(), list(torch.cuda.get_device_capability())]
    )
    attempt(report, "triton_kernel", triton_smoke)
    checkpoint(report)
    t0 = time.monotonic()
    try:
        import vllm
    except BaseException as e:
        e.partial = report  # type: ignore[attr-defined]
        raise
    report["vllm_version"] = vllm.__version__
    report["vllm_from"] = str(Path(vllm.__file__).parent)
    report["import_s"] = round(time.monotonic() - t0, 1)
    attempt(report, "platform", lambda: platform_report())
    attempt(report, "stand_in", stand_in_checks)
    attempt(report, "attention_backends", attention_backends)
    attempt(report, "llm_class", lambda: str(__import__("vllm").LLM))
    attempt(
        report, "model_runner_v2", lambda: bool(__import__("vllm.v1.worker.gpu.model_runner", fromlist=["x"]))
    )
    attempt(report, "connector", lambda: __import__("kv_connector.connector", fromlist=["x"]).__name__)
    attempt(report, "nixl", nixl_report)
    return report


def platform_report() -> dict[str, Any]:
    from vllm.platforms import current_platform

    return {
        "platform": type(current_platform).__name__,
        "is_cuda": current_platform.is_cuda(),
        "device_capability": str(current_platform.get_device_capability()),
    }


def nixl_report() -> dict[str, Any]:
    from importlib.metadata import version

    from nixl._api import nixl_agent  # noqa: F401

    return {"nixl": version("nixl"), "nixl-cu13": version("nixl-cu13")}


def token_prompts(batch: list[list[int]]) -> list[Any]:
    """vLLM's prompts of token ids (no tokenizer is loaded)."""
    return [{"prompt_token_ids": p} for p in batch]


def prompts() -> list[list[int]]:
    return [[random.Random(i).randrange(1, 1000) for _ in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


CONNECTOR = {
    "kv_connector": "HiddenStatesConnector",
    "kv_connector_module_path": "kv_connector.connector",
    "kv_role": "kv_producer",
}


# CUDA graphs captured for these batch sizes only (vLLM's default is about 50 of them):
# the prompts run piecewise-compiled either way, a few graphs prove the capture
CAPTURE_SIZES = [1, 2, 4, 8, 16]
KV_CACHE_BYTES = 256 << 20


def llm_kwargs(
    model: str,
    address: str | None,
    eager: bool,
    pull: bool,
    case: ModelCase = DENSE,
    prefix_caching: bool = False,
) -> dict[str, Any]:
    """``LLM``'s arguments for a stage, every name as vLLM 0.33 spells it
    (``entrypoints/llm.py``, ``engine/arg_utils.py``, ``config/{attention,cache,compilation,
    kernel,speculative,kv_transfer}.py``). ``prefix_caching``: the hybrid model's (the
    dense model's is vLLM's default)."""
    extra: dict[str, Any] = {"delivery": "pull"} if pull else {"consumer_address": address}
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(case.layer_ids)}},
    }
    if REHEARSAL:
        return {
            "model": model,
            "skip_tokenizer_init": True,
            "dtype": case.dtype,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": 16,
            "enforce_eager": True,
            "kv_cache_memory_bytes": 128 << 20,
            # vLLM's CPU build runs a hybrid model only without it (its mamba "align" mode is Triton)
            "enable_prefix_caching": case is not HYBRID,
            "speculative_config": spec,
            "kv_transfer_config": {**CONNECTOR, "kv_connector_extra_config": extra},
        }
    kw: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,
        "dtype": case.dtype,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 16,
        # the KV cache's size given: vLLM still compiles the model in its profile run, but
        # skips the memory profiling's throwaway CUDA-graph capture (v1/worker/gpu_worker.py)
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "enforce_eager": eager,
        "attention_config": {"backend": "TRITON_ATTN"},
        "compilation_config": {"custom_ops": ["none"], "cudagraph_capture_sizes": CAPTURE_SIZES},
        "kernel_config": {
            # vLLM's own native RMSNorm, never its compiled one (which does not travel)
            "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
            # no compiling of every top-k/top-p and attention kernel variant at start
            "enable_jit_warmup": False,
        },
        "speculative_config": spec,
        "kv_transfer_config": {**CONNECTOR, "kv_connector_extra_config": extra},
    }
    if os.environ.get(NO_ASYNC_SCHEDULING) == "1":
        kw["async_scheduling"] = False
    if case is HYBRID:
        # gated delta net prefill: vLLM picks FlashInfer on capability 9.0 without asking
        # whether it is installed (it is not on the host); its Triton kernels are carried
        kw["additional_config"] = {"gdn_prefill_backend": "triton"}
        kw["enable_prefix_caching"] = prefix_caching  # on: mamba_cache_mode "align"
    return kw


class StageError(RuntimeError):
    """A stage's failure with what it found so far (``partial``, reported with it)."""

    def __init__(self, message: str, partial: dict[str, Any]) -> None:
        super().__init__(message)
        self.partial = partial


def reference_states(model_dir: Path, batch: list[list[int]], layer_ids: tuple[int, ...]) -> list[Any]:
    """transformers' hidden states of each prompt on the GPU, fp32: ``output_hidden_states[k]``
    for k below the layer count, the last decoder layer's output (before the final norm,
    what vLLM captures) for k equal to it."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = loaded.to(REF_DEVICE).eval()
    n = model.config.num_hidden_layers
    out = []
    with torch.no_grad():
        for p in batch:
            last: list[Any] = []

            def keep(m: Any, a: Any, o: Any, last: list[Any] = last) -> None:
                last.append(o[0] if isinstance(o, tuple) else o)

            hook = model.model.layers[-1].register_forward_hook(keep)
            try:
                res = model(torch.tensor([p], device=REF_DEVICE), output_hidden_states=True, use_cache=False)
            finally:
                hook.remove()
            rows = [last[0][0] if k == n else res.hidden_states[k][0] for k in layer_ids]
            out.append(torch.stack(rows, dim=1).float())
    del model
    return out


def compare(
    samples: dict[tuple[int, ...], Any], batch: list[list[int]], model_dir: Path, case: ModelCase = DENSE
) -> dict[str, Any]:
    """Every prompt's sample against transformers: token ids exact, relative error."""
    import torch

    refs = reference_states(model_dir, batch, case.layer_ids)
    per_prompt = []
    problems = []
    for p, ref in zip(batch, refs, strict=True):
        s = samples.get(tuple(p))
        if s is None:
            problems.append(f"no sample for the prompt of {len(p)} tokens")
            continue
        got = s["hidden_states"].to(REF_DEVICE, torch.float32)
        row: dict[str, Any] = {"tokens": len(p), "shape": list(s["hidden_states"].shape)}
        row["device"] = str(s["hidden_states"].device)
        row["layer_ids"] = list(s["layer_ids"])
        if tuple(got.shape) != tuple(ref.shape):
            problems.append(f"{len(p)} tokens: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
            per_prompt.append(row)
            continue
        err = float((got - ref).norm() / ref.norm())
        row["relative_error"] = err
        row["max_abs_error"] = float((got - ref).abs().max())
        if err >= case.tolerance:
            problems.append(f"{len(p)} tokens: relative error {err:.3g} >= {case.tolerance}")
        if list(s["layer_ids"]) != list(case.layer_ids):
            problems.append(f"{len(p)} tokens: layer ids {s['layer_ids']} != {list(case.layer_ids)}")
        per_prompt.append(row)
    extra = set(samples) - {tuple(p) for p in batch}
    if extra:
        problems.append(f"{len(extra)} samples whose token ids match no prompt (token ids not exact?)")
    errs = [r["relative_error"] for r in per_prompt if "relative_error" in r]
    return {
        "per_prompt": per_prompt,
        "worst_relative_error": max(errs) if errs else None,
        "tolerance": case.tolerance,
        "problems": problems,
    }


def engine_facts(llm: Any) -> dict[str, Any]:
    cfg = llm.llm_engine.vllm_config
    cc = cfg.compilation_config
    return {
        "use_v2_model_runner": bool(cfg.use_v2_model_runner),
        "compilation_mode": str(cc.mode),
        "cudagraph_mode": str(cc.cudagraph_mode),
        "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or [])[:40],
        "attention_backend": str(cfg.attention_config.backend),
        "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
        "block_size": cfg.cache_config.block_size,
        "custom_ops": list(cc.custom_ops),
        "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
        "prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
        "mamba_cache_mode": str(getattr(cfg.cache_config, "mamba_cache_mode", None)),
        "jit_warmup": bool(getattr(cfg.kernel_config, "enable_jit_warmup", True)),
        "additional_config": dict(cfg.additional_config or {}),
    }


def stage_engine(
    work: Path,
    eager: bool,
    pool_device: str | None = None,
    pull: bool = False,
    v1: bool = False,
    case: ModelCase = DENSE,
    prefix_caching: bool = False,
) -> dict[str, Any]:
    """A tiny model through vLLM with our connector; every sample against transformers
    (``v1``: on vLLM's V1 model runner; ``case``: which model; ``prefix_caching``: the
    hybrid model's)."""
    if v1:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # read by vLLM when it builds its config
    if case is HYBRID:  # the plugin installs, or the stage fails saying why (never silently off)
        os.environ["HIDDEN_STATES_SUPPLEMENTARY"] = "1"
        # MoE routing without the padding sentinel the stand-in's ops need not honour
        os.environ["VLLM_MOE_SKIP_PADDING"] = "0"
    os.environ["KV_CONNECTOR_SYNC_CHECK"] = "1"  # each host sync in our hooks logged (a GPU only)
    import torch

    from scripts.support.make_tiny_model import build_tiny_model

    report: dict[str, Any] = {
        "eager": eager,
        "pool_device": pool_device,
        "delivery": "pull" if pull else "push",
        "v1_runner_asked": v1,
        "model": case.family,
        "dtype": case.dtype,
        "prefix_caching": prefix_caching if case is HYBRID else None,
    }
    model = build_tiny_model(work / f"tiny-{case.family}", case.family, seed=0, dtype=case.dtype)
    batch = prompts()
    report["prompt_lengths"] = [len(p) for p in batch]
    samples: dict[tuple[int, ...], dict[str, Any]] = {}
    try:
        from vllm import LLM, SamplingParams

        from kv_connector.reader import HiddenStatesReader

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.monotonic()
        if pull:
            llm = LLM(
                **llm_kwargs(str(model), None, eager, pull=True, case=case, prefix_caching=prefix_caching)
            )
            report["engine_start_s"] = round(time.monotonic() - t0, 1)
            attempt(report, "engine", lambda: engine_facts(llm))
            checkpoint(report)
            outs = llm.generate(token_prompts(batch), params)
            report["generated"] = [list(o.outputs[0].token_ids) for o in outs]
            checkpoint(report)
            samples = pull_samples(outs, report)
        else:
            reader_opts: dict[str, Any] = {"pool_bytes": 256 << 20}
            if pool_device is not None:
                reader_opts["pool_device"] = pool_device
            with HiddenStatesReader(**reader_opts) as reader:
                llm = LLM(
                    **llm_kwargs(
                        str(model),
                        reader.address,
                        eager,
                        pull=False,
                        case=case,
                        prefix_caching=prefix_caching,
                    )
                )
                report["engine_start_s"] = round(time.monotonic() - t0, 1)
                attempt(report, "engine", lambda: engine_facts(llm))
                checkpoint(report)
                outs = llm.generate(token_prompts(batch), params)
                report["generated"] = [list(o.outputs[0].token_ids) for o in outs]
                checkpoint(report)
                samples = push_samples(reader, len(batch), report)
        report["samples"] = len(samples)
        checkpoint(report)
        report["comparison"] = compare(samples, batch, model, case)
    except BaseException as e:
        raise StageError(f"{type(e).__name__}: {e}", report) from e
    if not REHEARSAL:
        torch.cuda.synchronize()
    problems = report["comparison"]["problems"]
    if problems:
        raise StageError("; ".join(problems), report)
    return report


SPEED_PAIRS = 3 if REHEARSAL else 7
SPEED_PROMPTS = 16 if REHEARSAL else 64  # a round: this many new prompts of SPEED_TOKENS tokens
SPEED_TOKENS = 256 if REHEARSAL else 1000  # under MAX_MODEL_LEN with the output token


def stage_speed(work: Path) -> dict[str, Any]:
    """``a_over_a0`` on this GPU: prefill tokens/s of the Llama with our connector pushing
    into a reader that takes every sample (timed to the last one taken) over the same
    engine without a connector, both alive at once, new prompts each round, paired by
    ``make bench``'s own ``run_pairs``."""
    from scripts.bench.paired import Run, run_pairs
    from scripts.support.make_tiny_model import build_tiny_model

    report: dict[str, Any] = {
        "pairs": SPEED_PAIRS, "prompts_per_round": SPEED_PROMPTS, "tokens_per_prompt": SPEED_TOKENS,
    }  # fmt: skip
    model = str(build_tiny_model(work / "tiny-llama", DENSE.family, seed=0, dtype=DENSE.dtype))
    try:
        from vllm import LLM, SamplingParams

        from kv_connector.reader import HiddenStatesReader

        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        tokens = SPEED_PROMPTS * SPEED_TOKENS
        with HiddenStatesReader(pool_bytes=1 << 30) as reader:
            t0 = time.monotonic()
            a = LLM(**llm_kwargs(model, reader.address, eager=False, pull=False))
            plain = llm_kwargs(model, None, eager=False, pull=False)
            del plain["kv_transfer_config"]
            a0 = LLM(**plain)
            report["engines_start_s"] = round(time.monotonic() - t0, 1)
            checkpoint(report)
            rounds = iter(range(1, 1 << 20))

            def batch() -> list[Any]:
                r = random.Random(next(rounds))
                ids = [[r.randrange(1, 1000) for _ in range(SPEED_TOKENS)] for _ in range(SPEED_PROMPTS)]
                return token_prompts(ids)

            def with_connector() -> Run:
                prompts = batch()
                t = time.monotonic()
                a.generate(prompts, params, use_tqdm=False)
                for _ in range(SPEED_PROMPTS):
                    reader.get(timeout=60).release()
                return Run(time.monotonic() - t, tokens)

            def without() -> Run:
                prompts = batch()
                t = time.monotonic()
                a0.generate(prompts, params, use_tqdm=False)
                return Run(time.monotonic() - t, tokens)

            pairs = run_pairs(with_connector, without, SPEED_PAIRS)  # after a warm-up pair
        report["tokens_per_s"] = {
            "a": [round(r.rate, 1) for r in pairs.a], "a0": [round(r.rate, 1) for r in pairs.b],
        }  # fmt: skip
        report["a_over_a0"], report["a_over_a0_range"] = pairs.ratio().rounded()
    except BaseException as e:
        raise StageError(f"{type(e).__name__}: {e}", report) from e
    return report


def sample_record(s: Any) -> dict[str, Any]:
    """What the comparison needs of a sample, copied out of the pool."""
    prov = getattr(s, "provenance", None)
    return {
        "token_ids": s.token_ids.tolist(),
        "hidden_states": s.hidden_states.clone(),
        "layer_ids": list(s.layer_ids),
        "provenance": prov.as_dict() if prov is not None else None,
    }


def push_samples(reader: Any, n: int, report: dict[str, Any]) -> dict[tuple[int, ...], dict[str, Any]]:
    got: dict[tuple[int, ...], dict[str, Any]] = {}
    t0 = time.monotonic()
    for i in range(n):
        try:
            s = reader.get(timeout=60 if i == 0 else 20)
        except TimeoutError:
            report["missing_samples"] = n - i
            break
        rec = sample_record(s)
        s.release()
        got[tuple(rec["token_ids"])] = rec
    report["receive_s"] = round(time.monotonic() - t0, 2)
    report["provenance"] = sorted({json.dumps(r["provenance"]) for r in got.values()})
    return got


def pull_samples(outs: list[Any], report: dict[str, Any]) -> dict[tuple[int, ...], dict[str, Any]]:
    from kv_connector.reader import PullClient

    got: dict[tuple[int, ...], dict[str, Any]] = {}
    client = PullClient()
    report["kv_transfer_params"] = [
        {k: v for k, v in (o.kv_transfer_params or {}).items() if k != "handle"} for o in outs
    ]
    errors = []
    for o in outs:
        try:
            s = client.fetch(o.kv_transfer_params)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}"[:400])
            continue
        rec = sample_record(s)
        s.release()
        got[tuple(rec["token_ids"])] = rec
    if errors:
        report["fetch_errors"] = errors
    report["provenance"] = sorted({json.dumps(r["provenance"]) for r in got.values()})
    return got


if __name__ == "__main__":
    main()
