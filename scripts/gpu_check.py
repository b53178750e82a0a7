"""The GPU check, in three tiers (docs/usage.md, "GPU check"):

    python -m scripts.gpu_check --tier device [--device cpu] [--plan]
    python -m scripts.gpu_check --tier engine [--only STAGE,...] [--plan]
    python -m scripts.gpu_check [--tier vllm] [--model DIR] [--prompts N] [--tokens T] [--only NAME,...]

The device tier (``scripts.gpu.device_tier``) needs only torch with CUDA and the carried
NIXL and msgspec wheels: our integrity record, step path and NIXL transfers on a GPU,
without vLLM. It fits a GPU host with no package index.

The engine tier (``scripts.gpu.engine_tier``) carries vLLM 0.33.0's own Python code (no
compiled kernels), the wheels it needs and NIXL to such a host (one folder: what travels
with the repository is limited to 64 MiB in all) and runs our producer inside vLLM there
against transformers.

The vLLM tier, below, needs a machine with a CUDA GPU, vLLM's CUDA build (0.32 or 0.33)
and the NIXL wheel for its torch.

Each check runs in a process of its own (a fresh engine, the GPU's memory back between
them) and reports ``{"ok": true, ...figures}`` or ``{"ok": false, "error": ...}``; one JSON
line at the end holds them all:

  dense            a tiny random Llama end to end: vLLM on Model Runner V2 (asserted on),
                   CUDA graphs on, extract_hidden_states -> HiddenStatesConnector -> NIXL
                   -> HiddenStatesReader; every sample against transformers'
                   output_hidden_states (fp32, on the host)
  hybrid           the same on a tiny Qwen3-Next (bf16) with the hybrid plugin, which must
                   say its supplementary tensor is active
  block_digests    ``scripts.gpu.integrity`` (also the device tier's first check): the
                   GPU's block digests bit for bit against the reader's CPU reference,
                   and their cost
  write            VRAM -> DRAM WRITE GB/s: NixlTransport from a registered GPU tensor
                   into another process's registered host memory
  extraction_cost  generate() time of vLLM with extract_hidden_states and this connector
                   (a reader taking every sample) over vLLM without extraction, on
                   ``--model`` (default: the tiny Llama), prefill only (what vLLM's
                   benchmarks/benchmark_hidden_state_extraction.py measures; upstream
                   claims within 10%)

The vLLM tier has not run yet: it needs a GPU host where vLLM's CUDA build installs. The
device tier ran on an H200 on 2026-11-28 (docs/benchmarks.md, "GPU runs"). Without a GPU
every tier refuses at once.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
LAYER_IDS = {"llama": [1, 2, 4], "qwen3_next": [1, 4, 8]}
CHECKS = ["dense", "hybrid", "block_digests", "write", "extraction_cost"]
CONNECTOR = {
    "kv_connector": "HiddenStatesConnector",
    "kv_connector_module_path": "kv_connector.connector",
    "kv_role": "kv_producer",
}


def refuse_without_gpu() -> None:
    """Exit with why, unless this process sees a CUDA GPU and vLLM's CUDA build."""
    if not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check needs a CUDA GPU (torch.cuda.is_available() is False here): it checks "
            "the GPU path (Model Runner V2, VRAM registration, GPU block digests); CI covers "
            "the CPU path"
        )
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise SystemExit(f"gpu_check needs vLLM's CUDA build; this vLLM's platform is {current_platform}")


def prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(tokens)] for _ in range(n)]


def tiny_model(family: str, work: Path) -> Path:
    from scripts.support.make_tiny_model import build_tiny_model

    dtype = "bfloat16" if family == "qwen3_next" else "float32"
    return build_tiny_model(work / f"tiny-{family}", family, seed=0, dtype=dtype)


def engine(model: Path, dtype: Any, layer_ids: list[int] | None, address: str, max_len: int) -> Any:
    """vLLM in this process, CUDA graphs on (what users run); with ``layer_ids``, the
    extract_hidden_states producer capturing them and shipping to ``address``."""
    from vllm import LLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # its config and scheduler are here to ask
    extra: dict[str, Any] = {}
    if layer_ids is not None:
        spec = {"eagle_aux_hidden_state_layer_ids": layer_ids}
        extra = {
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": spec},
            },
            "kv_transfer_config": {**CONNECTOR, "kv_connector_extra_config": {"consumer_address": address}},
        }
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        gpu_memory_utilization=0.5,
        enable_prefix_caching=False,
        **extra,
    )


def check_pipeline(family: str, work: Path) -> dict[str, Any]:
    """A tiny model end to end on Model Runner V2; every sample against transformers."""
    from vllm import SamplingParams

    from kv_connector.reader import HiddenStatesReader

    conftest = importlib.import_module("tests.e2e.conftest")  # the e2e tests' transformers reference
    model = tiny_model(family, work)
    layer_ids = LAYER_IDS[family]
    dtype = "bfloat16" if family == "qwen3_next" else "float32"
    if family == "qwen3_next":
        os.environ["HIDDEN_STATES_SUPPLEMENTARY"] = "1"
    lengths = [1, 15, 16, 17, 300, 1000]
    batch = [[random.Random(i).randrange(1, 1000) for _ in range(n)] for i, n in enumerate(lengths)]
    with HiddenStatesReader() as reader:
        llm = engine(model, dtype, layer_ids, reader.address, 2048)
        cfg = llm.llm_engine.vllm_config
        if not cfg.use_v2_model_runner:
            raise AssertionError("Model Runner V2 is off: every GPU user of vLLM 0.32/0.33 runs it")
        graphs = str(cfg.compilation_config.cudagraph_mode)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in batch], params)
        got = {}
        for _ in batch:
            s = reader.get(timeout=120, copy=True)
            got[tuple(s.token_ids.tolist())] = s
    ref = conftest.Reference(model)
    tolerance = 2e-2 if dtype == "bfloat16" else 1e-3  # GPU kernels (TF32 matmuls) vs fp32 on the host
    worst = 0.0
    for p in batch:
        s = got.pop(tuple(p))
        assert s.layer_ids == tuple(layer_ids), s.layer_ids
        err = float(conftest.relative_error(s.hidden_states, ref.states(p, layer_ids)))
        assert err < tolerance, (len(p), err)
        worst = max(worst, err)
    assert not got, f"samples nobody asked for: {len(got)}"
    return {"v2": True, "cudagraph_mode": graphs, "samples": len(batch), "worst_relative_error": worst}


def check_block_digests() -> dict[str, Any]:
    from scripts.gpu import integrity

    return integrity.check(torch.device("cuda"))


def check_write(total_mib: int = 1024, chunk_mib: int = 64) -> dict[str, Any]:
    """VRAM -> DRAM: WRITEs of ``chunk_mib`` from a registered GPU tensor into another
    process's registered host memory, ``total_mib`` in all, posted together."""
    import multiprocessing as mp

    from kv_connector.wire.nixl_transport import NixlTransport
    from kv_connector.wire.transport import Region
    from scripts.bench.datapath.raw import raw_target_proc

    chunk, n = chunk_mib << 20, total_mib // chunk_mib
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=raw_target_proc, args=(b, total_mib << 20))
    proc.start()
    try:
        src = torch.randint(0, 256, (total_mib << 20,), dtype=torch.uint8, device="cuda")
        t = NixlTransport(f"gpu-check-{os.getpid()}")
        local = t.register(src)
        md, addr, nbytes = a.recv()
        peer = t.add_peer(md)
        a.send(t.metadata)
        remote = Region(addr, nbytes, "DRAM", 0)

        def write_all(count: int) -> float:
            a.send(("expect", count))
            t0 = time.perf_counter()
            spans = [[(i * chunk, i * chunk, chunk)] for i in range(count)]
            xfers = [t.write(peer, local, remote, one, b"x") for one in spans]
            while xfers:
                xfers = [x for x in xfers if not t.poll(x)]
            seconds = time.perf_counter() - t0
            a.recv()  # the target saw every notification
            return seconds

        write_all(1)  # warm-up: connection and registration caches
        seconds = write_all(n)
        a.send(("stop",))
        t.close()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return {
        "bytes": n * chunk,
        "seconds": seconds,
        "write_GBps": n * chunk / seconds / 1e9,
        "mem": local.mem_type,
    }


def check_generate(model: Path, extract: bool, n: int, tokens: int) -> dict[str, Any]:
    """generate() of ``n`` prompts of ``tokens`` tokens, one output token each, timed after
    a warm-up; with ``extract``, a reader takes every sample as it comes."""
    from vllm import SamplingParams

    from kv_connector.reader import HiddenStatesReader

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    taken = [0]
    stop = threading.Event()
    with HiddenStatesReader(pool_bytes=2 << 30) as reader:

        def take() -> None:
            while not stop.is_set():
                try:
                    reader.get(timeout=0.1, copy=True)
                    taken[0] += 1
                except TimeoutError:
                    continue

        drain = threading.Thread(target=take, daemon=True)
        drain.start()
        layer_ids = LAYER_IDS["llama"] if extract else None
        llm = engine(model, "bfloat16", layer_ids, reader.address, max(tokens + 16, 2048))
        llm.generate([{"prompt_token_ids": p} for p in prompts(8, tokens, 1)], params)  # warm-up
        batch = [{"prompt_token_ids": p} for p in prompts(n, tokens, 2)]
        t0 = time.perf_counter()
        llm.generate(batch, params)
        seconds = time.perf_counter() - t0
        deadline = time.monotonic() + 120
        while extract and taken[0] < n + 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        drain.join(timeout=5)
    return {"seconds": seconds, "tokens_per_s": n * tokens / seconds, "samples": taken[0]}


def run_part(args: list[str], env: dict[str, str] | None = None, timeout: float = 1800) -> dict[str, Any]:
    """``python -m scripts.gpu_check --part ...`` in a new process: its JSON line."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "scripts.gpu_check", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"did not finish within {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"ok": False, "error": (proc.stderr or proc.stdout)[-3000:]}
    out: dict[str, Any] = json.loads(lines[-1])
    out["log"] = proc.stdout + proc.stderr
    return out


def part(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One check, in this process."""
    work = Path(args.work)
    if name in ("dense", "hybrid"):
        return check_pipeline("llama" if name == "dense" else "qwen3_next", work)
    if name == "block_digests":
        return check_block_digests()
    if name == "write":
        return check_write()
    if name in ("generate", "generate_extract"):
        model = Path(args.model) if args.model else tiny_model("llama", work)
        return check_generate(model, name == "generate_extract", args.prompts, args.tokens)
    raise SystemExit(f"unknown part {name!r}")


def main() -> None:
    from scripts.support.stopping import raise_on_termination

    raise_on_termination()  # SIGTERM/SIGHUP unwind like Ctrl-C: every stage's processes stop
    tier = argparse.ArgumentParser(add_help=False)
    tier.add_argument("--tier", choices=["device", "engine", "vllm"], default="vllm")
    known, rest = tier.parse_known_args()
    if known.tier == "device":
        from scripts.gpu import device_tier

        device_tier.main(rest)
        return
    if known.tier == "engine":
        from scripts.gpu import engine_tier

        engine_tier.main(rest)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tier", choices=["device", "engine", "vllm"], default="vllm", help="which tier (see above)"
    )
    ap.add_argument("--model", help="model for extraction_cost (default: the tiny Llama)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks to run")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    refuse_without_gpu()
    if args.part:
        print(json.dumps({"ok": True, **part(args.part, args)}), flush=True)
        return
    import vllm

    work = tempfile.mkdtemp(prefix="gpu-check-")
    common = ["--work", work, "--prompts", str(args.prompts), "--tokens", str(args.tokens)]
    common += ["--model", args.model] if args.model else []
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "vllm": vllm.__version__}
    result["torch_cuda"] = torch.version.cuda
    out: dict[str, Any]
    for name in [c for c in args.only.split(",") if c]:
        if name not in CHECKS:
            raise SystemExit(f"unknown check {name!r}; the checks are {', '.join(CHECKS)}")
        if name == "extraction_cost":
            base = run_part(["--part", "generate", *common])
            ours = run_part(["--part", "generate_extract", *common])
            ok = bool(base.get("ok") and ours.get("ok"))
            out = {"ok": ok, "without": base, "with_connector": ours}
            if ok:
                out["cost"] = ours["seconds"] / base["seconds"] - 1.0
        else:
            out = run_part(["--part", name, *common])
        if name == "hybrid" and out.get("ok"):
            out["plugin_active"] = "hybrid supplementary tensors active" in out.get("log", "")
            out["ok"] = out["plugin_active"]
        for sub in (out, out.get("without", {}), out.get("with_connector", {})):
            sub.pop("log", None)
        result[name] = out
        print(f"gpu_check: {name}: {'ok' if out.get('ok') else 'FAILED'}", file=sys.stderr, flush=True)
    result["ok"] = all(result[c].get("ok") for c in CHECKS if c in result)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
