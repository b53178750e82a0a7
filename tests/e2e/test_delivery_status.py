"""What a request's kv_transfer_params say about its sample, with real vLLM: requests
wait (holding no blocks) while no worker reaches the reader, run and are delivered when
it comes up late, or, past connect_timeout_s, run without shipping and report the error;
the engine never hangs and every block comes back."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kv_connector.reader import HiddenStatesReader, Sample
from tests.e2e.common import BLOCK, LAYER_IDS
from tests.e2e.conftest import Reference, prompts_of, relative_error, run_producer, start_producer
from tests.engines import EngineSpec, Run
from tests.ports import address_of, held_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.fresh_engine("no reader at the address its connector was given")
def test_without_a_reader_requests_fail_clearly_in_their_kv_transfer_params(tiny_llama: Path) -> None:
    held = held_port()  # ours for the whole test, and nobody listens on it: refused
    address = address_of(held)
    prompts = prompts_of([5, 40, 300], seed=31)
    with held:
        spec = EngineSpec.of(tiny_llama, LAYER_IDS, {"connect_timeout_s": 3}, block_size=BLOCK)
        res = run_producer(spec, Run(prompts, max_tokens=[1, 3, 2]), address, timeout=300)
    assert res["rc"] == 0, res["stderr"][-4000:]
    # they waited for the reader for the deadline, not forever
    assert 3.0 <= res["elapsed_s"] < 60, res["elapsed_s"]
    for o in res["outputs"]:
        hs = o["kv_transfer_params"]["hidden_states"]
        assert hs["status"] == "failed", hs
        assert f"cannot reach the reader at {address} for 3 s" in hs["error"], hs
        assert "refused" in hs["error"].lower(), hs  # the last connection error, named
        assert len(o["output_token_ids"]) >= 1  # the request itself ran
    assert res["kv_usage"] == 0.0  # no block held
    assert "runs without shipping its hidden states" in res["log"]


@pytest.mark.fresh_engine("a reader that starts after the engine")
def test_requests_wait_for_a_reader_that_starts_late_and_arrive_exact(
    tiny_llama: Path, llama_reference: Reference
) -> None:
    # the reader's port, held (refusing connections) until the reader takes the socket
    held = held_port()
    prompts = prompts_of([7, 130, 260, 1], seed=32)
    spec = EngineSpec.of(tiny_llama, LAYER_IDS, {"connect_timeout_s": 120}, block_size=BLOCK)
    proc = start_producer(spec, Run(prompts, max_tokens=[1, 40, 2, 1]), address_of(held))
    got: dict[str, Sample] = {}
    try:
        assert proc.stderr is not None
        early = []
        for line in proc.stderr:  # wait until the engine is up and generate() was called
            early.append(line)
            if "producer: generating" in line:
                break
        time.sleep(3)  # its requests wait for the reader meanwhile
        assert proc.poll() is None, "".join(early)[-4000:]
        with HiddenStatesReader(listen=held) as reader:
            while len(got) < len(prompts):
                s = reader.get(timeout=120, copy=True)
                assert s.request_id not in got
                got[s.request_id] = s
            out, err = proc.communicate(timeout=300)
            with pytest.raises(TimeoutError):
                reader.get(timeout=1.0)
    finally:
        held.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    result = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    for o, prompt in zip(result["outputs"], prompts, strict=True):
        hs = o["kv_transfer_params"]["hidden_states"]
        assert hs["status"] in ("delivered", "pending"), hs
        s = got[o["request_id"]]
        assert s.token_ids.tolist() == prompt
        assert relative_error(s.hidden_states, llama_reference.states(prompt, LAYER_IDS)) < 1e-4
    assert "not reachable" in out + "".join(early) + err  # the producer said it was retrying
    assert result["elapsed_s"] >= 3  # generate() waited for the reader
