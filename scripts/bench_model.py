"""What the connector costs the producer, on a tiny model, prefill only:

  a:  vLLM with extract_hidden_states + HiddenStatesConnector + a reader in another
      process taking every sample (timed until the last sample is taken);
  a0: vLLM with extract_hidden_states and no connector (what extraction costs vLLM
      itself: a/a0 is the connector's own overhead);
  c:  the same vLLM without extraction and without a connector.

Each runs in a fresh process with the in-process engine; a warm-up batch runs first.
"""

from __future__ import annotations

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

LAYER_IDS = [1, 2, 4]


def _producer(spec: dict[str, Any]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if spec["extract"]:
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS}},
        }
    if spec["connector"]:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"consumer_address": spec["address"]},
        }
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=4096,
        max_num_batched_tokens=spec["batch_tokens"],
        kv_cache_memory_bytes=512 << 20,
        enforce_eager=True,
        **kwargs,
    )
    params = SamplingParams(max_tokens=1)
    warm = [TokensPrompt(prompt_token_ids=p) for p in spec["warmup"]]
    llm.generate(warm, params, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    t0 = time.time()
    llm.generate(prompts, params, use_tqdm=False)
    t1 = time.time()
    print(json.dumps({"t0": t0, "t1": t1}), flush=True)


def run(
    model: Path,
    prompts: list[list[int]],
    warmup: list[list[int]],
    extract: bool,
    batch_tokens: int,
    connector: bool | None = None,
) -> dict[str, float]:
    from kv_connector.reader import HiddenStatesReader

    connector = extract if connector is None else connector
    reader = HiddenStatesReader(pool_bytes=256 << 20) if connector else None
    times: list[float] = []
    n_expected = len(prompts) + len(warmup)

    def consume() -> None:
        assert reader is not None
        for _ in reader.samples(n_expected, timeout=600):
            times.append(time.time())

    th = threading.Thread(target=consume, daemon=True)
    if reader is not None:
        th.start()
    spec = {
        "model": str(model),
        "prompts": prompts,
        "warmup": warmup,
        "extract": extract,
        "connector": connector,
        "batch_tokens": batch_tokens,
        "address": reader.address if reader else "",
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench_model", "--producer", f.name],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"producer failed:\n{proc.stderr[-4000:]}")
    res = json.loads(lines[-1])
    end = res["t1"]
    if reader is not None:
        th.join(timeout=600)
        reader.close()
        if len(times) != n_expected:
            raise RuntimeError(f"reader got {len(times)} of {n_expected} samples")
        end = max(end, times[-1])
    tokens = sum(map(len, prompts))
    return {"seconds": end - res["t0"], "tokens": float(tokens), "tokens_per_s": tokens / (end - res["t0"])}


def main(
    n_prompts: int = 96, length: int = 1024, batch_tokens: int = 4096, rounds: int = 2
) -> dict[str, Any]:
    from scripts.make_tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="hs-bench-model-"))
    model = build_tiny_model(work / "tiny-llama", "llama", seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1024) for _ in range(length)] for _ in range(n_prompts)]
    warmup = [[rng.randrange(1, 1024) for _ in range(length)] for _ in range(4)]
    # Interleaved, best of `rounds` each: this host is shared and noisy, and the ratio is
    # only worth something if both sides saw the same machine.
    cs, a0s, as_ = [], [], []
    for _ in range(rounds):
        cs.append(run(model, prompts, warmup, extract=False, batch_tokens=batch_tokens))
        a0s.append(run(model, prompts, warmup, extract=True, batch_tokens=batch_tokens, connector=False))
        as_.append(run(model, prompts, warmup, extract=True, batch_tokens=batch_tokens))
    c = max(cs, key=lambda r: r["tokens_per_s"])
    a0 = max(a0s, key=lambda r: r["tokens_per_s"])
    a = max(as_, key=lambda r: r["tokens_per_s"])
    return {
        "a_extract_connector_reader": a,
        "a0_extract_no_connector": a0,
        "c_no_extraction": c,
        "a_over_c": a["tokens_per_s"] / c["tokens_per_s"],
        "a_over_a0": a["tokens_per_s"] / a0["tokens_per_s"],
        "all_rounds_tokens_per_s": {
            "a": [r["tokens_per_s"] for r in as_],
            "a0": [r["tokens_per_s"] for r in a0s],
            "c": [r["tokens_per_s"] for r in cs],
        },
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--producer":
        _producer(json.loads(Path(sys.argv[2]).read_text()))
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        print(json.dumps(main(), indent=1))
