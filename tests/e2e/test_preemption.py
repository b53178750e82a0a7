"""Preemption with real vLLM while samples are on their way: a KV budget too small for
the batch makes vLLM preempt running requests whose prompts were shipped, while a slow
trainer and a small reader pool keep their WRITEs waiting for credits. The connector
must hold the engine until those WRITEs landed (or the freed blocks would be reused
under them), and every sample must arrive once, equal to the transformers reference."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from kv_connector.reader import HiddenStatesReader, Sample
from tests.e2e.common import BLOCK, LAYER_IDS
from tests.e2e.conftest import Reference, prompts_of, relative_error, start_producer
from tests.engines import EngineSpec, Run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.fresh_engine("a KV budget small enough for vLLM to preempt")
def test_requests_preempted_while_their_writes_wait_arrive_exact(
    tiny_llama: Path, llama_reference: Reference
) -> None:
    block_bytes = BLOCK * len(LAYER_IDS) * 128 * 4  # one block of the tiny model (hidden 128, fp32)
    prompts = prompts_of([200, 150, 250, 180, 220, 130, 240, 170], seed=41)
    with HiddenStatesReader(pool_bytes=4 * block_bytes) as reader:  # two 2-block samples
        spec = EngineSpec.of(
            tiny_llama, LAYER_IDS, block_size=BLOCK, max_num_seqs=len(prompts), max_model_len=640,
            kv_cache_memory_bytes=5 << 20,  # 11 blocks of 128 tokens: prompt + 300 outputs overflow it
        )  # fmt: skip
        proc = start_producer(spec, Run(prompts, max_tokens=[300] * len(prompts)), reader.address)
        got: dict[str, Sample] = {}
        try:
            while len(got) < len(prompts):
                try:
                    s = reader.get(timeout=5, copy=True)
                except TimeoutError:
                    assert proc.poll() is None, proc.communicate()[1][-4000:]
                    continue
                assert s.request_id not in got
                got[s.request_id] = s
                time.sleep(0.3)  # a slow trainer: shipped prompts wait for credits
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, err[-4000:]
        with pytest.raises(TimeoutError):
            reader.get(timeout=1.0)
    log = out + err
    waits = re.findall(
        r"tracked requests preempted, (\d+) shipped ones not yet written; waited ([0-9.]+) s", log
    )
    assert waits, "vLLM preempted no tracked request: make the KV budget smaller"
    assert any(int(n) > 0 and float(s) > 0 for n, s in waits), (
        f"no preempted request had a WRITE pending: {waits}"
    )
    result = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    for o, prompt in zip(result["outputs"], prompts, strict=True):
        assert len(o["output_token_ids"]) == 300
        s = got[o["request_id"]]
        assert s.token_ids.tolist() == prompt
        assert relative_error(s.hidden_states, llama_reference.states(prompt, LAYER_IDS)) < 1e-4
