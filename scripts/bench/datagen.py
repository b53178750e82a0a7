"""The data-generation driver's throughput on the tiny model, beside the same rows through
``LLM.generate`` in one process; both into the reader CLI (``--layout speculators``):

  driver:   vLLM's OpenAI server (its own processes) with HiddenStatesConnector, driven by
            ``python -m kv_connector.datagen --concurrency N``, timed by the driver until
            every row's file was confirmed;
  generate: ``LLM.generate`` over the same rows (the in-process engine, the same
            connector, each row's sample id in its ``SamplingParams``), timed from the
            call until the CLI has written every file.

Each path runs a warm-up batch first. Prints one JSON line.

    python -m scripts.bench.datagen [--rows 256] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LAYER_IDS = [1, 2, 4]
BATCH_TOKENS = 2048
KV_BYTES = 512 << 20


def kv_config(address: str) -> dict[str, Any]:
    from scripts.support.vllm_server import connector_config

    return connector_config({"consumer_address": address})


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN"}


def start_cli(out: Path, n: int | None) -> tuple[subprocess.Popen[str], str, socket.socket]:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    host, port = held.getsockname()[:2]
    cmd = [sys.executable, "-m", "kv_connector.reader", "--listen-fd", str(held.fileno()), "--out", str(out),
           "--layout", "speculators", "--pool-mib", "256", "--log-level", "WARNING"]  # fmt: skip
    if n is not None:
        cmd += ["--max-samples", str(n)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                            pass_fds=(held.fileno(),))  # fmt: skip
    return proc, f"{host}:{port}", held


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def driver_run(
    model: Path, rows: list[list[int]], warm: list[list[int]], work: Path, conc: int
) -> dict[str, Any]:
    from scripts.support.vllm_server import VllmServer

    out = work / "driver-out"
    out.mkdir()
    cli, address, held = start_cli(out, None)
    server = VllmServer(
        model, kv_config(address), LAYER_IDS, work, name="server", dtype="bfloat16",
        kv_cache_bytes=KV_BYTES, env={"NIXL_LOG_LEVEL": "WARN"}, stop_timeout_s=60.0,
        args=["--max-num-batched-tokens", str(BATCH_TOKENS), "--block-size", "128"],
    )  # fmt: skip
    try:
        server.start()
        server.wait_healthy(600.0)  # or ServerFailed with its log's tail
        _drive(work, "warm", warm, server.http.url, out, conc)
        return _drive(work, "rows", rows, server.http.url, out, conc)
    finally:
        server.stop()
        stop(cli)
        held.close()


def _drive(work: Path, name: str, data: list[list[int]], url: str, out: Path, conc: int) -> dict[str, Any]:
    """``python -m kv_connector.datagen`` over ``data``: its summary line."""
    jsonl = work / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in data))
    proc = subprocess.run(
        [sys.executable, "-m", "kv_connector.datagen", "--jsonl", str(jsonl),
         "--server", url, "--concurrency", str(conc), "--check-dir", str(out),
         "--retries", "0"],
        capture_output=True, text=True, env=env(), cwd=REPO, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"driver failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


def _generate(spec: dict[str, Any]) -> None:
    """The one-process path (a child process of its own: vLLM's state is per process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from scripts.support.vllm_server import speculative_config

    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
        enforce_eager=True, kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=BATCH_TOKENS,
        block_size=128, speculative_config=speculative_config(LAYER_IDS),
        kv_transfer_config=kv_config(spec["address"]),
    )  # fmt: skip

    def batch(rows: list[list[int]]) -> tuple[list[TokensPrompt], list[SamplingParams]]:
        prompts = [TokensPrompt(prompt_token_ids=r) for r in rows]
        params = [
            SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"sample_id": str(i)}})
            for i in range(len(rows))
        ]
        return prompts, params

    llm.generate(*batch(spec["warm"]), use_tqdm=False)
    t0 = time.time()
    llm.generate(*batch(spec["rows"]), use_tqdm=False)
    print(json.dumps({"t0": t0, "t_generate": time.time()}), flush=True)


def generate_run(model: Path, rows: list[list[int]], warm: list[list[int]], work: Path) -> dict[str, Any]:
    out = work / "generate-out"
    out.mkdir()
    cli, address, held = start_cli(out, len(warm) + len(rows))
    spec_file = work / "generate.json"
    spec_file.write_text(json.dumps({"model": str(model), "address": address, "rows": rows, "warm": warm}))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "scripts.bench.datagen", "--generate", str(spec_file)],
            capture_output=True, text=True, env=env(), cwd=REPO, timeout=1800,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"generate failed:\n{proc.stderr[-3000:]}")
        times = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
        if cli.wait(timeout=600) != 0:
            raise RuntimeError(f"reader CLI failed:\n{stop(cli)[-3000:]}")
        t_end = time.time()
    finally:
        stop(cli)
        held.close()
    elapsed = t_end - times["t0"]
    tokens = sum(len(r) for r in rows)
    assert len(list(out.glob("hs_*.safetensors"))) == len(rows)
    return {
        "elapsed_s": round(elapsed, 3),
        "generate_s": round(times["t_generate"] - times["t0"], 3),
        "rows_per_s": round(len(rows) / elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--generate", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate is not None:
        _generate(json.loads(Path(args.generate).read_text()))
        return
    from scripts.support.make_tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="hs-datagen-"))
    try:
        model = build_tiny_model(work / "tiny-llama-bf16", "llama", seed=0, dtype="bfloat16")
        rng = random.Random(0)
        rows = [[rng.randrange(1, 1024) for _ in range(rng.randint(args.min_len, args.max_len))]
                for _ in range(args.rows)]  # fmt: skip
        warm = [[rng.randrange(1, 1024) for _ in range(256)] for _ in range(8)]
        d = driver_run(model, rows, warm, work, args.concurrency)
        g = generate_run(model, rows, warm, work)
        print(
            json.dumps(
                {
                    "rows": len(rows),
                    "tokens": sum(len(r) for r in rows),
                    "concurrency": args.concurrency,
                    "driver": {
                        k: d[k] for k in ("elapsed_s", "rows_per_s", "tokens_per_s", "retries", "failed")
                    },
                    "generate": g,
                    "driver_over_generate": round(d["tokens_per_s"] / g["tokens_per_s"], 3),
                }
            ),
            flush=True,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
