"""Pull delivery through real vLLM (CPU build): ``LLM.generate`` with ``"delivery":
"pull"`` holds each finished request's blocks; this process fetches every sample by the
handle in its kv_transfer_params with ``reader.pull.client.PullClient`` (NIXL READs straight
from vLLM's cache), and checks its tokens and states against transformers. Afterwards vLLM
holds no KV block; a sample never fetched is freed by ``pull_timeout_s`` and then
answers "expired"."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kv_connector.reader import FetchError, PullClient
from kv_connector.wire.handle import decode_handle
from scripts.support.deaths import explain, program_env
from tests.e2e.common import kv_cache_usage
from tests.e2e.conftest import REPO, Reference, prompts_of, relative_error
from tests.engines import STARTS, Engines, EngineSpec, Start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYER_IDS = [1, 2, 4]
BLOCK = 128
PULL_TIMEOUT_S = 25.0


class PullProducer:
    """``pull_producer_main.py`` in its own process (vLLM's log and ours go to its stdout,
    kept in ``lines``); its commands as methods."""

    def __init__(self, spec: dict[str, Any]) -> None:
        STARTS.count("pull producer", Start.FRESH if spec.get("prompts") else Start.SHARED)
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "e2e" / "pull_producer_main.py"), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=program_env(),
        )
        self.lines: list[str] = []  # what it printed besides its JSON lines (vLLM's log, ours)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        kv_params: list[dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        """generate() on these prompts: each output's kv_transfer_params and generated tokens."""
        run = {"prompts": prompts, "max_tokens": max_tokens, "kv_params": kv_params}
        answer: dict[str, Any] = self.command("generate " + json.dumps(run))
        return answer

    def first(self) -> dict[str, Any]:
        return self._answer()

    def step(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._answer()

    def step_until_held(self, held: list[str], within_s: float = 20.0) -> dict[str, Any]:
        """Engine steps until exactly ``held`` are held (or ``within_s`` passes); the last
        state. A fenced release gets no answer, so its rank takes it when it comes."""
        deadline = time.monotonic() + within_s
        state = self.step()
        while state["held"] != held and time.monotonic() < deadline:
            time.sleep(0.05)
            state = self.step()
        return state

    def command(self, line: str) -> Any:
        """One stdin command of pull_producer_main.py; its JSON answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        while out := self.proc.stdout.readline():
            if out.startswith(("{", '"')):
                return json.loads(out)
            self.lines.append(out)
        raise AssertionError(f"producer died: {self.stop()[-5000:]}")

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith("{"):
                out: dict[str, Any] = json.loads(line)
                return out
            self.lines.append(line)
        raise AssertionError(f"producer died: {self.stop()[-5000:]}")

    def stop(self) -> str:
        """Its output since the last answer, ending with how it or its workers died."""
        if self.proc.poll() is not None:
            log = "".join(self.lines) + (self.proc.stdout.read() if self.proc.stdout else "")
        else:
            try:
                out, _ = self.proc.communicate("quit\n", timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, _ = self.proc.communicate()
            log = "".join(self.lines) + out
        why = explain(log, self.proc.returncode, "producer")
        return log + (f"\n{why}" if why else "")


@pytest.fixture
def llama_pull(request: pytest.FixtureRequest, engines: Engines, tiny_llama: Path) -> PullProducer:
    """The tiny Llama's in-process pull producer (``LAYER_IDS``, block 128, the default
    record; a sample nobody fetches freed after ``PULL_TIMEOUT_S``), shared by this module's
    tests: each generates its own prompts."""
    spec = {"model": str(tiny_llama), "layer_ids": LAYER_IDS, "block_size": BLOCK,
            "extra": {"pull_timeout_s": PULL_TIMEOUT_S}}  # fmt: skip
    key = (
        EngineSpec.of(tiny_llama, LAYER_IDS, {"delivery": "pull", "pull_timeout_s": PULL_TIMEOUT_S}),
        "pull",
    )
    return engines.shared(key, request.fixturename, lambda: PullProducer(spec))


def test_generate_in_pull_mode_serves_every_sample_and_frees_every_block(
    llama_pull: PullProducer, llama_reference: Reference
) -> None:
    lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 300, 45]
    prompts = prompts_of(lengths, seed=24)
    never = len(prompts)  # one more prompt, never fetched: the timeout frees it
    prompts.append(prompts_of([200], seed=25)[0])
    producer = llama_pull
    log_from = len(producer.lines)
    outputs = producer.generate(prompts, [1, 3, 1, 2, 1, 4, 1])["outputs"]
    t_done = time.monotonic()
    params = outputs[:never]
    for p in outputs:
        assert p["hidden_states"]["status"] == "ready" and p["hidden_states"]["delivery"] == "pull", p
        assert set(p) == {"handle", "hidden_states"} and len(p["handle"]) < 300
    with PullClient(pool_bytes=16 << 20) as client:
        samples = [client.fetch(params[0])]  # one, then the rest in flight together
        many = client.fetch_many(params[1:])
        assert not any(isinstance(s, FetchError) for s in many), many
        samples += [s for s in many if not isinstance(s, FetchError)]
        worst = 0.0
        for i, s in enumerate(samples):
            assert s.token_ids.tolist() == prompts[i]
            assert s.hidden_states.shape == (len(prompts[i]), len(LAYER_IDS), 128)
            assert s.request_id == decode_handle(params[i]["handle"]).request_id
            err = relative_error(s.hidden_states, llama_reference.states(prompts[i], LAYER_IDS))
            assert err < 1e-4, (i, err)
            worst = max(worst, err)
            s.release()
        print(f"{len(samples)} samples, worst relative error {worst:.2e}")
        with pytest.raises(FetchError) as e:
            client.fetch(params[2])  # released: its blocks may hold anything now
        assert e.value.code == "released"
        # every fetched sample's blocks go back to vLLM; the one never fetched holds
        # its blocks until pull_timeout_s, then it is freed too
        state = producer.step_until_held([outputs[never]["hidden_states"]["request_id"]])
        assert state["held"] == [outputs[never]["hidden_states"]["request_id"]], state
        assert state["kv_usage"] > 0
        while time.monotonic() < t_done + PULL_TIMEOUT_S + 60 and state["held"]:
            time.sleep(1.0)
            state = producer.step()
        assert state == {"kv_usage": 0.0, "held": []}, state
        assert time.monotonic() >= t_done + PULL_TIMEOUT_S - 5
        with pytest.raises(FetchError) as e:
            client.fetch(outputs[never])
        assert e.value.code == "expired"
    log = "".join(producer.lines[log_from:])
    assert "was not released within pull_timeout_s" in log, log[-3000:]


@pytest.mark.parametrize(
    ("checksum", "asked"),
    [("auto", False), ("auto", True), ("none", False)],
    ids=["before-ask", "after-ask", "none"],
)
@pytest.mark.fresh_engine("with the record off (the none case)")
def test_a_row_overwritten_after_generate_returned_fails_its_sample_by_name(
    checksum: str, asked: bool, llama_pull: PullProducer, tiny_llama: Path, llama_reference: Reference
) -> None:
    """One token's row of a held sample is overwritten in vLLM's cache with another
    prompt's row right after ``generate()`` returned, with no engine step since: before
    any consumer asked for it, or after one asked for its manifest. The default record
    (fingerprints taken in the step that wrote each slot) fails the fetch naming the sample
    and hands out nothing, and the other samples arrive exact; with the record off the
    changed row is handed out."""
    prompts = prompts_of([BLOCK + 9, 40, 70], seed=31)
    if checksum == "auto":  # the default record: the module's shared producer
        producer = llama_pull
        outputs = producer.generate(prompts, [1, 1, 1])["outputs"]
    else:
        spec = {"model": str(tiny_llama), "layer_ids": LAYER_IDS, "block_size": BLOCK, "prompts": prompts,
                "max_tokens": [1, 1, 1], "extra": {"checksum": checksum}}  # fmt: skip
        producer = PullProducer(spec)
        outputs = producer.first()["outputs"]
    try:
        with PullClient(pool_bytes=16 << 20) as client:
            if asked:
                assert client.manifest(outputs[0]).token_ids == prompts[0]
            assert producer.command("overwrite 0 3 1") == "overwritten"
            if checksum == "auto":
                with pytest.raises(FetchError) as e:
                    client.fetch(outputs[0])
                rid = decode_handle(outputs[0]["handle"]).request_id
                assert e.value.code == "checksum" and f"sample {rid}" in e.value.message, e.value
            else:
                got = client.fetch(outputs[0])
                ref = llama_reference.states(prompts[0], LAYER_IDS)
                assert relative_error(got.hidden_states[3], ref[3]) > 0.1  # the changed row, handed out
                assert relative_error(got.hidden_states[4:], ref[4:]) < 1e-4
                got.release()
            for i in (1, 2):
                s = client.fetch(outputs[i])
                assert relative_error(s.hidden_states, llama_reference.states(prompts[i], LAYER_IDS)) < 1e-4
                s.release()
            if checksum == "auto":  # the failed sample's hold ends now: the shared engine holds nothing
                with contextlib.suppress(FetchError):
                    client.release(outputs[0])
                assert producer.step_until_held([])["held"] == []
    finally:
        if checksum != "auto":
            producer.stop()


def test_output_tokens_in_pull_mode_are_exact_over_the_whole_sequence(
    llama_pull: PullProducer, llama_reference: Reference
) -> None:
    """``include_output_tokens`` in pull delivery: the sample of a request that generated
    is held in the engine step after its response went out (the in-process engine takes
    that step when asked: here "step"; a server's engine takes it at once), and holds the
    states of its prompt and of every generated token but the last (never forwarded),
    exact against transformers over that whole sequence."""
    prompts = prompts_of([5, BLOCK - 2, 300], seed=27)
    max_tokens = [1, 4, 9]
    producer = llama_pull
    first = producer.generate(prompts, max_tokens, [{"include_output_tokens": True}] * len(prompts))
    assert all(p["hidden_states"]["status"] == "ready" for p in first["outputs"]), first
    producer.step()  # the step that holds what request_finished shipped
    with PullClient(pool_bytes=16 << 20) as client:
        for prompt, n, params, generated in zip(
            prompts, max_tokens, first["outputs"], first["generated"], strict=True
        ):
            s = client.fetch(params)
            want = prompt + generated[:-1]
            assert len(generated) == n and s.token_ids.tolist() == want
            err = relative_error(s.hidden_states, llama_reference.states(want, LAYER_IDS))
            assert err < 1e-4, (len(prompt), n, err)
            s.release()
    state = producer.step_until_held([])
    assert state["held"] == [] and state["kv_usage"] == 0.0, state


@pytest.mark.fresh_engine("a TP=2 server")
def test_openai_server_with_two_ranks_serves_each_share_gathered_into_one_sample(
    tiny_llama: Path, llama_reference: Reference, tmp_path: Path
) -> None:
    """TP=2 behind the OpenAI server: the handle names both ranks' endpoints, each serves
    its stripe of the blocks, the client gathers them into one sample, output tokens
    included when a request asks; afterwards vLLM's kv_cache_usage_perc is back to 0."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.api_server import ApiServer, tail

    prompts = prompts_of([1, BLOCK, BLOCK + 1, 300, 700], seed=26)
    with (
        ApiServer(
            tiny_llama,
            {"delivery": "pull"},
            LAYER_IDS,
            tmp_path,
            args=["--block-size", str(BLOCK), "--tensor-parallel-size", "2"],
            env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        ) as server,
        ThreadPoolExecutor(len(prompts)) as pool,
    ):
        body = {"model": str(tiny_llama), "max_tokens": 1, "temperature": 0}
        responses = list(
            pool.map(lambda p: server.http.post_json("/v1/completions", {**body, "prompt": p}), prompts)
        )
        params = [r["kv_transfer_params"] for r in responses]
        assert all(len(decode_handle(p["handle"]).endpoints) == 2 for p in params), params
        # and requests that ship their output tokens: held in the step after their response
        with_output = {
            **body,
            "max_tokens": 5,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": {"include_output_tokens": True},
        }
        generated = list(
            pool.map(
                lambda p: server.http.post_json("/v1/completions", {**with_output, "prompt": p}), prompts[:3]
            )
        )
        with PullClient() as client:
            for i, s in enumerate(client.fetch_many(params)):
                assert not isinstance(s, FetchError), (i, s)
                assert s.token_ids.tolist() == prompts[i]
                err = relative_error(s.hidden_states, llama_reference.states(prompts[i], LAYER_IDS))
                assert err < 1e-4, (i, err)
            for i, r in enumerate(generated):  # fetched as soon as each response is here
                out = r["choices"][0]["token_ids"]
                s = client.fetch(r["kv_transfer_params"])
                want = prompts[i] + out[:-1]
                assert len(out) == 5 and s.token_ids.tolist() == want, (i, out)
                err = relative_error(s.hidden_states, llama_reference.states(want, LAYER_IDS))
                assert err < 1e-4, (i, "with output tokens", err)
                s.release()
        usage = kv_cache_usage(server)
        for _ in range(30):
            if usage == 0:
                break
            time.sleep(0.5)
            usage = kv_cache_usage(server)
        assert usage == 0.0, tail(server.log)
        # a client that gives up mid-generation: vLLM aborts the request after its prompt
        # was captured; nobody gets its handle, and its hold ends at once (not at the timeout)
        with pytest.raises(OSError):
            server.http.post_json(
                "/v1/completions",
                {**body, "prompt": prompts[3], "max_tokens": 1900, "ignore_eos": True},
                timeout=3,
            )
        t0 = time.monotonic()
        while time.monotonic() < t0 + 60 and (usage := kv_cache_usage(server)) != 0:
            time.sleep(0.5)
        assert usage == 0.0, tail(server.log)
        assert "Aborted request" in server.log.read_text() or "abort" in server.log.read_text().lower()


@pytest.mark.fresh_engine("two data-parallel replicas")
def test_two_data_parallel_replicas_each_name_their_own_endpoint_and_serve_their_samples(
    tiny_llama: Path, llama_reference: Reference, tmp_path: Path
) -> None:
    """``--data-parallel-size 2`` behind the OpenAI server, in pull delivery: each replica is
    a producer of its own name, and a handle names the endpoint of the replica that ran
    its request; every sample is fetched once, exact; afterwards no replica holds a block."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.api_server import ApiServer, tail

    prompts = prompts_of([1, BLOCK, BLOCK + 1, 300, 2, 3, 5, 7], seed=27)
    with (
        ApiServer(
            tiny_llama,
            {"delivery": "pull", "producer_id": "replicas"},
            LAYER_IDS,
            tmp_path,
            args=["--block-size", str(BLOCK), "--data-parallel-size", "2"],
        ) as server,
        ThreadPoolExecutor(len(prompts)) as pool,
    ):
        body = {"model": str(tiny_llama), "max_tokens": 1, "temperature": 0}
        responses = list(
            pool.map(lambda p: server.http.post_json("/v1/completions", {**body, "prompt": p}), prompts)
        )
        params = [r["kv_transfer_params"] for r in responses]
        handles = [decode_handle(p["handle"]) for p in params]
        by_replica: dict[str, set[str]] = {}
        for h in handles:
            by_replica.setdefault(h.producer_id, set()).update(h.endpoints)
        # vLLM spreads concurrent requests over both replicas; each serves at its own endpoint
        assert set(by_replica) == {"replicas-dp0", "replicas-dp1"}, by_replica
        assert all(len(e) == 1 for e in by_replica.values()), by_replica
        assert by_replica["replicas-dp0"] != by_replica["replicas-dp1"]
        with PullClient() as client:
            for i, s in enumerate(client.fetch_many(params)):
                assert not isinstance(s, FetchError), (i, s)
                assert s.token_ids.tolist() == prompts[i] and s.producer_id == handles[i].producer_id
                err = relative_error(s.hidden_states, llama_reference.states(prompts[i], LAYER_IDS))
                assert err < 1e-4, (i, err)
                s.release()
        deadline = time.monotonic() + 15
        while (held := _usages(server)) and any(u != 0.0 for u in held) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(held) == 2 and held == [0.0, 0.0], (held, tail(server.log))


def _usages(server: Any) -> list[float]:
    """``vllm:kv_cache_usage_perc`` of each engine (each data-parallel replica)."""
    return [
        float(line.rsplit(" ", 1)[1])
        for line in server.http.get_text("/metrics").splitlines()
        if line.startswith("vllm:kv_cache_usage_perc{")
    ]


@pytest.mark.fresh_engine("a KV budget small enough for vLLM to preempt")
def test_preempted_requests_fail_by_name_and_the_rest_arrive_exact(
    tiny_llama: Path, llama_reference: Reference, tmp_path: Path
) -> None:
    """A KV budget too small for the batch makes vLLM preempt running requests whose
    prompts were captured: their holds end before the step that reuses their blocks, their
    responses say "failed" (preempted) with no handle; every other sample, fetched as its
    response arrives (held samples take KV blocks), is exact; afterwards vLLM holds no
    block."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.api_server import ApiServer, tail

    prompts = prompts_of([200, 150, 250, 180, 220, 130, 240, 170], seed=41)
    # 11 blocks of 128 tokens: the prompts and 120 outputs each overflow it
    args = ["--block-size", str(BLOCK), "--kv-cache-memory-bytes", str(5 << 20), "--max-model-len", "640"]
    with (
        ApiServer(tiny_llama, {"delivery": "pull"}, LAYER_IDS, tmp_path, args=args) as server,
        PullClient() as client,
    ):
        body = {"model": str(tiny_llama), "max_tokens": 120, "temperature": 0, "ignore_eos": True}

        def run(i: int) -> tuple[dict[str, Any], Any]:
            answer = server.http.post_json("/v1/completions", {**body, "prompt": prompts[i]})
            params = answer["kv_transfer_params"]
            if params["hidden_states"]["status"] != "ready":
                return params, None
            s = client.fetch(params)  # at once: a held sample takes KV blocks
            assert s.token_ids.tolist() == prompts[i]
            states = s.hidden_states.clone()
            s.release()
            return params, states

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(run, range(len(prompts))))
        failed = [p for p, states in results if states is None]
        errs = [
            relative_error(states, llama_reference.states(prompts[i], LAYER_IDS))
            for i, (_, states) in enumerate(results)
            if states is not None
        ]
        assert failed, "vLLM preempted no captured request: make the KV budget smaller"
        for p in failed:
            assert "handle" not in p and "preempted" in p["hidden_states"]["error"], p
        assert errs and max(errs) < 1e-4, errs
        t0 = time.monotonic()
        while time.monotonic() < t0 + 30 and (usage := kv_cache_usage(server)) != 0:
            time.sleep(0.5)
        assert usage == 0.0, tail(server.log)
        assert "preempted by vLLM before a consumer fetched it" in server.log.read_text()
    print(f"{len(failed)} preempted, {len(errs)} delivered")
