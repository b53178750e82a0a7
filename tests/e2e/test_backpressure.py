"""Back-pressure with real vLLM: a trainer slower than the producer and a reader pool that
holds two samples. The producer must hold blocks and wait for credits (never drop,
never overwrite), vLLM must keep running inside its KV budget, and every sample must
arrive exactly once, equal to the transformers reference."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kv_connector.reader import HiddenStatesReader, Sample
from tests.e2e.common import BLOCK, LAYER_IDS
from tests.e2e.conftest import Reference, prompts_of, relative_error, start_producer
from tests.engines import EngineSpec, Run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.fresh_engine("a KV budget and a reader pool too small for the batch")
def test_slow_trainer_throttles_the_producer_and_loses_nothing(
    tiny_llama: Path, llama_reference: Reference
) -> None:
    block_bytes = BLOCK * len(LAYER_IDS) * 128 * 4  # one block of the tiny model (hidden 128, fp32)
    prompts = prompts_of([300, 129, 50, 256, 1, 300, 200, 128, 77, 260, 300, 10], seed=21)
    # pool: 6 blocks, i.e. two 3-block samples; KV budget: ~32 blocks of the model's layers
    with HiddenStatesReader(pool_bytes=6 * block_bytes) as reader:
        spec = EngineSpec.of(
            tiny_llama, LAYER_IDS, block_size=BLOCK, max_num_seqs=4, kv_cache_memory_bytes=8 << 20,
            inprocess=False,
        )  # fmt: skip
        proc = start_producer(spec, Run(prompts), reader.address)
        got: dict[str, Sample] = {}
        try:
            for _ in prompts:
                s = reader.get(timeout=300, copy=True)
                assert s.request_id not in got
                got[s.request_id] = s
                time.sleep(0.5)  # the trainer is slow
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, err[-4000:]
        with pytest.raises(TimeoutError):
            reader.get(timeout=1.0)
        assert reader.stats().refused == 0
    result = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert {o["request_id"] for o in result["outputs"]} == set(got)
    for o, prompt in zip(result["outputs"], prompts, strict=True):
        s = got[o["request_id"]]
        assert s.token_ids.tolist() == prompt
        assert relative_error(s.hidden_states, llama_reference.states(prompt, LAYER_IDS)) < 1e-4
