"""Real vLLM (CPU build) -> HiddenStatesConnector -> NIXL -> HiddenStatesReader.

The received states must equal the transformers model's output_hidden_states[k] for the
configured layer ids, token_ids must equal the prompt, and each request must arrive
exactly once, without stepping the engine after generate() returned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kv_connector.reader import HiddenStatesReader, Sample
from tests.e2e.common import BLOCK, LAYER_IDS
from tests.e2e.conftest import (
    LLAMA_LAYERS,
    Reference,
    check_samples,
    prompts_of,
    relative_error,
    run_and_collect,
)
from tests.engines import EngineSpec, Run, SharedProducer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def check_against_reference(
    got: dict[str, Sample],
    result: dict[str, Any],
    prompts: list[list[int]],
    ref: Reference,
    with_output: set[int],
) -> float:
    """fp32 states equal the reference to about 1e-6; 1e-4 leaves room for the kernels."""
    return check_samples(got, result, prompts, ref, LAYER_IDS, with_output)


def test_inprocess_engine_chunked_prefill_mixed_batch(
    llama_push: SharedProducer, llama_reference: Reference
) -> None:
    """The shared engine takes 256 tokens a step: 700 and 1000 span several steps, each
    batch mixes prefills and decodes."""
    lengths = [1, BLOCK, BLOCK + 1, 2 * BLOCK, 700, 37, 1000, 5]
    prompts = prompts_of(lengths, seed=11)
    run = Run(prompts, max_tokens=[1, 1, 3, 1, 2, 5, 1, 4])
    out = llama_push.collect(run, len(prompts))
    worst = check_samples(out.samples, out.result, prompts, llama_reference, LLAMA_LAYERS, set())
    print(f"worst relative error {worst:.2e}")


@pytest.mark.fresh_engine("vLLM's multi-process engine")
def test_multiprocess_engine_and_output_tokens_opt_in(tiny_llama: Path, llama_reference: Reference) -> None:
    lengths = [3, BLOCK, 300, 129]
    prompts = prompts_of(lengths, seed=12)
    with HiddenStatesReader() as reader:
        spec = EngineSpec.of(tiny_llama, LAYER_IDS, block_size=BLOCK, inprocess=False)
        run = Run(prompts, max_tokens=[2, 1, 4, 6], with_output=[2, 3])
        got, result, _ = run_and_collect(reader, spec, run, len(prompts))
    check_against_reference(got, result, prompts, llama_reference, with_output={2, 3})


def test_output_tokens_of_a_request_that_finishes_while_others_run_free_their_blocks(
    llama_push: SharedProducer, llama_reference: Reference
) -> None:
    """A request shipping its output tokens is shipped in the step that also tells the
    workers it finished; with a drafter (extract_hidden_states), vLLM asks for finished
    transfers before the step's shipping: the finish must still be followed, or vLLM holds
    the request's blocks for ever. Here it finishes while a longer request still decodes."""
    prompts = prompts_of([40, 200, 9], seed=13)
    run = Run(
        prompts, max_tokens=[3, 12, 2], with_output=[0, 2], drain_steps=3
    )  # 0, 2 finish while 1 decodes
    out = llama_push.collect(run, len(prompts))
    check_samples(out.samples, out.result, prompts, llama_reference, LLAMA_LAYERS, with_output={0, 2})
    assert out.result["held_requests"] == [] and out.result["kv_usage"] == 0.0, out.result


@pytest.mark.fresh_engine("layer ids given unsorted, and the start-up log's one line about them")
def test_unsorted_layer_ids_label_each_slice_with_its_layer(
    tiny_llama: Path, llama_reference: Reference
) -> None:
    """Configured [3, 1, 2]: vLLM captures layers 1, 2, 3 in that order, and each slice
    ``hidden_states[:, i]`` must be the layer its label ``layer_ids[i]`` names, checked one
    layer at a time (a mislabelled slice is another layer: off by ~1, not 1e-6)."""
    prompts = prompts_of([5, BLOCK + 2, 300], seed=14)
    with HiddenStatesReader() as reader:
        spec = EngineSpec.of(tiny_llama, [3, 1, 2], block_size=BLOCK, max_num_batched_tokens=BLOCK)
        got, result, log = run_and_collect(reader, spec, Run(prompts), len(prompts))
    for o, prompt in zip(result["outputs"], prompts, strict=True):
        s = got[o["request_id"]]
        assert s.token_ids.tolist() == prompt
        for i, k in enumerate(s.layer_ids):
            err = relative_error(s.hidden_states[:, i], llama_reference.states(prompt, [k])[:, 0])
            assert err < 1e-4, (s.request_id, f"slice {i} labelled layer {k}", err)
        assert s.layer_ids == (1, 2, 3)
    assert log.count("every sample reports layer_ids=[1, 2, 3]") == 1, log[-3000:]


@pytest.mark.fresh_engine("TP=4: four worker processes")
@pytest.mark.alone  # four ranks on two cores: a second test beside them stretches vLLM's shutdown grace
@pytest.mark.multinode
def test_real_tensor_parallel_4_engine_matches_transformers(tmp_path: Path) -> None:
    """vLLM's own TP=4 executor (four CPU worker processes, gloo), each rank shipping its
    stripe of every sample; the reader completes a sample only when all four ranks'
    shares landed. ~2 minutes on two cores."""
    from scripts.support.make_tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny-llama-kv4", "llama", seed=1, num_key_value_heads=4)
    lengths = [1, BLOCK, BLOCK + 1, 300, 700]
    prompts = prompts_of(lengths, seed=13)
    with HiddenStatesReader() as reader:
        spec = EngineSpec.of(
            model, LAYER_IDS, block_size=BLOCK, tp=4, inprocess=False, max_num_batched_tokens=256,
            env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        )  # fmt: skip
        got, result, _ = run_and_collect(reader, spec, Run(prompts), len(prompts))
    check_against_reference(got, result, prompts, Reference(model), with_output=set())
