"""Sample ids and metadata with real vLLM (``LLM.generate``, ``SamplingParams.extra_args``):
they come out on the reader's samples and the response's kv_transfer_params name the
sample; a request with a bad sample id or bad metadata fails alone, with the reason in
its kv_transfer_params, while the rest of its batch ships."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import LLAMA_LAYERS, Reference, prompts_of, relative_error
from tests.engines import Run, SharedProducer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_sample_ids_and_metadata_reach_the_reader_and_a_bad_one_fails_alone(
    llama_push: SharedProducer, llama_reference: Reference
) -> None:
    prompts = prompts_of([5, 130, 40, 7], seed=41)
    kv_params = [
        {"sample_id": "17", "metadata": {"source": "sharegpt", "turn": 1, "tags": ["a", "b"]}},
        None,  # no identity: known by its request id
        {"sample_id": "bad id!"},
        {"sample_id": "3", "metadata": ["not", "an", "object"]},
    ]
    run = Run(
        prompts,
        kv_params=kv_params,
        max_tokens=[1, 3, 1, 2],
        with_output=[1],
        drain_steps=3,  # the in-process engine ships an output-token sample at its next step
    )
    out = llama_push.collect(run, 2)
    got, result, log = out.samples, out.result, out.log
    outs = result["outputs"]
    # the good ones: the sample carries its id and metadata, the response names it
    first, plain = got[outs[0]["request_id"]], got[outs[1]["request_id"]]
    assert (first.sample_id, first.metadata) == ("17", kv_params[0]["metadata"])  # type: ignore[index]
    assert (plain.sample_id, plain.metadata) == (plain.request_id, {})
    assert outs[0]["kv_transfer_params"]["hidden_states"]["sample_id"] == "17"
    assert outs[1]["kv_transfer_params"]["hidden_states"]["sample_id"] == plain.request_id
    assert first.token_ids.tolist() == prompts[0]
    assert plain.token_ids.tolist() == prompts[1] + outs[1]["output_token_ids"][:-1]
    for s in (first, plain):
        ref = llama_reference.states(s.token_ids.tolist(), LLAMA_LAYERS)
        assert relative_error(s.hidden_states, ref) < 1e-4
    # the bad ones: ran, shipped nothing, and say why
    for o, fragment in ((outs[2], "may only contain"), (outs[3], "metadata must be a JSON object")):
        hs = o["kv_transfer_params"]["hidden_states"]
        assert (
            hs["status"] == "failed"
            and "invalid kv_transfer_params" in hs["error"]
            and fragment in hs["error"]
        )
        assert len(o["output_token_ids"]) >= 1
        assert f"request {o['request_id']}: invalid kv_transfer_params" in log
