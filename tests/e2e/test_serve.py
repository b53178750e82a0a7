"""The OpenAI-compatible server (CPU build) -> HiddenStatesConnector -> NIXL -> reader.

Starts ``vllm.entrypoints.openai.api_server`` in a subprocess with extract_hidden_states
and the connector as a kv_producer, with two data-parallel replicas, sends token-id
completions over HTTP, then rows through the data-generation driver, and checks that
each request's prompt hidden states reach the reader exactly once and equal the
transformers model's, each replica a producer of its own name."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kv_connector.reader import HiddenStatesReader, Sample
from tests.e2e.api_server import ApiServer, tail
from tests.e2e.conftest import REPO, Reference, relative_error

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYER_IDS = [1, 2, 4]
PRODUCER = "served"  # a name given in the options: each replica adds -dp{n}
BLOCK = 128  # pinned in the server's configuration (--block-size), so prompts cross it
SAMPLE_TIMEOUT_S = 300.0
_driven = random.Random(22)
# rows the data-generation driver sends (python -m kv_connector.datagen), after the posts
DRIVEN = [[_driven.randrange(1, 1024) for _ in range(n)] for n in (3, BLOCK + 2, 9, 64, 257, 17)]


@pytest.mark.fresh_engine("a server whose log must show no refused connection from its start")
def test_openai_server_delivers_prompt_states(
    tiny_llama: Path, llama_reference: Reference, tmp_path: Path
) -> None:
    lengths = [1, BLOCK, BLOCK + 1, 300, 2, 3, 5, 7]
    max_tokens = [1, 3, 1, 3, 1, 2, 1, 2]
    rng = random.Random(21)
    prompts = [[rng.randrange(1, 1024) for _ in range(n)] for n in lengths]
    with (
        HiddenStatesReader() as reader,
        ApiServer(
            tiny_llama,
            {"consumer_address": reader.address, "producer_id": PRODUCER},
            LAYER_IDS,
            tmp_path,
            args=["--block-size", str(BLOCK), "--data-parallel-size", "2"],
        ) as server,
    ):

        def complete(i: int) -> dict[str, Any]:
            # Token-id prompts need no tokenizer: the completion API has no "detokenize"
            # field, and with --skip-tokenizer-init the server just does not detokenize.
            return server.http.post_json(
                "/v1/completions",
                {
                    "model": str(tiny_llama),
                    "prompt": prompts[i],
                    "max_tokens": max_tokens[i],
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )

        def hostile(kind: str) -> dict[str, Any]:
            """A user picks a request id that cannot name a sample (vLLM builds its own
            from the header or the body's request_id): refused alone, at admission."""
            body = {"model": str(tiny_llama), "prompt": prompts[3], "max_tokens": 1, "temperature": 0}
            if kind == "header":
                return server.http.post_json("/v1/completions", body, headers={"X-Request-Id": "a b/c"})
            if kind == "newline":
                return server.http.post_json("/v1/completions", {**body, "request_id": "line\n"})
            return server.http.post_json("/v1/completions", {**body, "request_id": "x" * 256})

        # The first one alone, then the rest concurrently (with the hostile ones) so the
        # server batches them.
        responses = [complete(0)]
        with ThreadPoolExecutor(len(prompts) + 2) as pool:
            bad = [pool.submit(hostile, k) for k in ("header", "newline", "long")]
            responses += list(pool.map(complete, range(1, len(prompts))))
            refused = [f.result() for f in bad]
        print("first response:", json.dumps(responses[0]))
        for r in responses[1:]:
            print("kv_transfer_params:", json.dumps(r.get("kv_transfer_params")))

        got: dict[str, Sample] = {}
        for _ in prompts:
            s = reader.get(timeout=SAMPLE_TIMEOUT_S, copy=True)
            assert s.request_id not in got, f"{s.request_id} delivered twice"
            got[s.request_id] = s
        with pytest.raises(TimeoutError):
            extra = reader.get(timeout=2.0)
            pytest.fail(f"unexpected extra sample {extra.request_id}")
        assert server.alive(), f"server died:\n{tail(server.log)}"
        address = reader.address
        assert reader.stats().refused == 0  # the reader never saw them

        # the data-generation driver on the same replicas: each row delivered once, by either
        jsonl = tmp_path / "rows.jsonl"
        jsonl.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in DRIVEN))
        driver = subprocess.run(
            [sys.executable, "-m", "kv_connector.datagen", "--jsonl", str(jsonl),
             "--server", server.http.url, "--concurrency", str(len(DRIVEN))],
            capture_output=True, text=True, cwd=REPO, timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert driver.returncode == 0, driver.stderr[-3000:]
        summary = json.loads(driver.stdout.splitlines()[-1])
        driven: dict[str, Sample] = {}
        for _ in DRIVEN:
            s = reader.get(timeout=SAMPLE_TIMEOUT_S, copy=True)
            assert s.sample_id not in driven, f"row {s.sample_id} delivered twice"
            driven[s.sample_id] = s
        with pytest.raises(TimeoutError):
            extra = reader.get(timeout=2.0)
            pytest.fail(f"unexpected extra sample {extra.request_id}")

    for r in refused:
        params = r["kv_transfer_params"]["hidden_states"]
        assert params["status"] == "failed" and "cannot name a sample" in params["error"], params
        assert r["usage"]["completion_tokens"] == 1  # the request itself ran
    log = server.log.read_text(errors="replace")
    assert "lost the reader" not in log and "will be resent" not in log  # no connection was refused

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
        assert params["consumer_address"] == address
        assert params["producer_id"] == s.producer_id
        assert params["request_id"].startswith(resp["id"] + "-0-")
    # two replicas, two producers: vLLM spreads the concurrent requests over both
    assert {s.producer_id for s in got.values()} == {f"{PRODUCER}-dp0", f"{PRODUCER}-dp1"}
    assert summary["delivered"] == len(DRIVEN) and summary["failed"] == 0, summary
    assert sorted(driven) == [str(i) for i in range(len(DRIVEN))]
    assert {s.producer_id for s in driven.values()} <= {f"{PRODUCER}-dp0", f"{PRODUCER}-dp1"}
    for row, s in driven.items():
        prompt = DRIVEN[int(row)]
        assert s.token_ids.tolist() == prompt
        err = relative_error(s.hidden_states, llama_reference.states(prompt, LAYER_IDS))
        assert err < 1e-4, (row, err)
        worst = max(worst, err)
    print(f"worst relative error {worst:.2e}")
