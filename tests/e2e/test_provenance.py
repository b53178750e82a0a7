"""A sample from real vLLM says what produced it: the vLLM version, the model runner (V1
on the CPU build) and the model; a reader expecting exactly that takes it, and its file
keeps it in its header."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm
from safetensors import safe_open

from kv_connector.files.cli import write_sample
from kv_connector.wire.provenance import Expectation, ModelRunner, Provenance
from tests.e2e.conftest import LLAMA_BLOCK, LLAMA_LAYERS, Reference, prompts_of, relative_error
from tests.engines import Run, SharedProducer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_real_sample_names_its_producer_and_model_and_its_file_keeps_them(
    llama_push: SharedProducer, tiny_llama: Path, llama_reference: Reference, tmp_path: Path
) -> None:
    """The shared engine's reader expects its model, layers, dtype and hidden size: a real
    sample meets that expectation and is handed out."""
    prompts = prompts_of([9, LLAMA_BLOCK + 1], seed=52)
    expect = llama_push.reader.config.expect
    assert expect == Expectation(
        layer_ids=LLAMA_LAYERS, dtype="float32", hidden_size=128, model=tiny_llama.name
    )
    got = llama_push.collect(Run(prompts), len(prompts)).samples
    assert llama_push.reader.stats().refused_mismatch == 0
    want = Provenance(vllm_version=vllm.__version__, model_runner=ModelRunner.V1, model=str(tiny_llama))
    for sample in got.values():
        assert sample.provenance == want
        i = prompts.index(sample.token_ids.tolist())
        assert relative_error(sample.hidden_states, llama_reference.states(prompts[i], LLAMA_LAYERS)) < 1e-4
    sample = next(iter(got.values()))
    path = write_sample(tmp_path / "s.safetensors", sample)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["vllm_version"] == vllm.__version__ and meta["model_runner"] == "v1"
    assert meta["model"] == str(tiny_llama) and meta["layer_ids"] == "1,2,3,4"
