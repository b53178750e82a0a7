"""The OpenAI-compatible server (CPU build) -> HiddenStatesConnector -> NIXL -> reader.

Starts ``vllm.entrypoints.openai.api_server`` in a subprocess with extract_hidden_states
and the connector as a kv_producer, sends token-id completions over HTTP, and checks that
each request's prompt hidden states reach the reader exactly once and equal the
transformers model's."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kv_connector.reader import HiddenStatesReader, Sample
from tests.e2e.conftest import REPO, Reference, relative_error

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYER_IDS = [1, 2, 4]
CPU_BLOCK = 128  # vLLM's CPU block size
STARTUP_DEADLINE_S = 420.0
SAMPLE_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def start_server(model: Path, consumer_address: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    # The CPU build's `vllm` console script dies at start (PackageNotFoundError), so run the
    # api_server module directly; it takes the same flags as `vllm serve`.
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS}},
    }
    kv = {
        "kv_connector": "HiddenStatesConnector",
        "kv_connector_module_path": "kv_connector.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"consumer_address": consumer_address},
    }
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(128 << 20),
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with log.open("wb") as f:  # a file, not a pipe: the server logs a lot and must not block
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def wait_healthy(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} during startup:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    pytest.fail(f"server not healthy within {STARTUP_DEADLINE_S} s:\n{tail(log)}")


def post_json(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            result: dict[str, Any] = json.loads(r.read())
            return result
    except urllib.error.HTTPError as e:
        raise AssertionError(f"HTTP {e.code} from {url}: {e.read().decode(errors='replace')}") from None


def test_openai_server_delivers_prompt_states(
    tiny_llama: Path, llama_reference: Reference, tmp_path: Path
) -> None:
    lengths = [1, CPU_BLOCK, CPU_BLOCK + 1, 300]
    max_tokens = [1, 3, 1, 3]
    rng = random.Random(21)
    prompts = [[rng.randrange(1, 1024) for _ in range(n)] for n in lengths]
    log = tmp_path / "server.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    reader = HiddenStatesReader()
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = start_server(tiny_llama, reader.address, port, log)
        t0 = time.monotonic()
        wait_healthy(proc, base, log)
        print(f"server healthy after {time.monotonic() - t0:.1f} s")

        def complete(i: int) -> dict[str, Any]:
            # Token-id prompts need no tokenizer: the completion API has no "detokenize"
            # field, and with --skip-tokenizer-init the server just does not detokenize.
            return post_json(
                f"{base}/v1/completions",
                {
                    "model": str(tiny_llama),
                    "prompt": prompts[i],
                    "max_tokens": max_tokens[i],
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )

        # The first one alone, then the rest concurrently so the server batches them.
        responses = [complete(0)]
        with ThreadPoolExecutor(len(prompts) - 1) as pool:
            responses += list(pool.map(complete, range(1, len(prompts))))
        print("first response:", json.dumps(responses[0]))
        for r in responses[1:]:
            print("kv_transfer_params:", json.dumps(r.get("kv_transfer_params")))

        got: dict[str, Sample] = {}
        for _ in prompts:
            s = reader.get(timeout=SAMPLE_TIMEOUT_S)
            assert s.request_id not in got, f"{s.request_id} delivered twice"
            got[s.request_id] = s
        with pytest.raises(TimeoutError):
            extra = reader.get(timeout=2.0)
            pytest.fail(f"unexpected extra sample {extra.request_id}")
        assert proc.poll() is None, f"server died:\n{tail(log)}"
    finally:
        if proc is not None:
            stop_server(proc)
        reader.close()

    by_len = {len(s.token_ids): s for s in got.values()}
    assert sorted(by_len) == sorted(lengths)
    worst = 0.0
    for prompt, resp in zip(prompts, responses, strict=True):
        s = by_len[len(prompt)]
        assert resp["usage"]["prompt_tokens"] == len(prompt)
        assert s.token_ids.tolist() == prompt
        assert s.layer_ids == tuple(LAYER_IDS)
        assert s.hidden_states.shape == (len(prompt), len(LAYER_IDS), 128)
        err = relative_error(s.hidden_states, llama_reference.states(prompt, LAYER_IDS))
        assert err < 1e-4, (len(prompt), err)
        worst = max(worst, err)
        # The server returns the connector's request_finished() params in the response
        # body: they name the engine's request id, which is the sample's request id. The
        # response "id" ("cmpl-X") is not it: the engine's is "cmpl-X-<prompt index>-<suffix>".
        params = resp["kv_transfer_params"]["hidden_states"]
        assert params["request_id"] == s.request_id
        assert params["consumer_address"] == reader.address
        assert params["producer_id"] == s.producer_id
        assert params["request_id"].startswith(resp["id"] + "-0-")
    print(f"worst relative error {worst:.2e}")
