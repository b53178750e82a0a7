"""A sample from real vLLM says what produced it: the vLLM version, the model runner (V1
on the CPU build) and the model; a reader expecting exactly that takes it, and its file
keeps it in its header."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm
from safetensors import safe_open

from kv_connector.files.cli import write_sample
from kv_connector.reader import HiddenStatesReader
from kv_connector.wire.provenance import Expectation, ModelRunner, Provenance
from tests.e2e.conftest import Reference, prompts_of, relative_error, run_and_collect

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYER_IDS = [1, 2, 4]
BLOCK = 128


def test_a_real_sample_names_its_producer_and_model_and_its_file_keeps_them(
    tiny_llama: Path, llama_reference: Reference, tmp_path: Path
) -> None:
    prompts = prompts_of([9, BLOCK + 1], seed=52)
    expect = Expectation(layer_ids=LAYER_IDS, dtype="float32", hidden_size=128, model=tiny_llama.name)
    with HiddenStatesReader(expect=expect) as reader:
        spec = dict(model=str(tiny_llama), address=reader.address, layer_ids=LAYER_IDS, block_size=BLOCK)
        got, _, _ = run_and_collect(reader, {**spec, "prompts": prompts}, len(prompts))
        assert reader.stats().refused_mismatch == 0
    want = Provenance(vllm_version=vllm.__version__, model_runner=ModelRunner.V1, model=str(tiny_llama))
    for sample in got.values():
        assert sample.provenance == want
        i = prompts.index(sample.token_ids.tolist())
        assert relative_error(sample.hidden_states, llama_reference.states(prompts[i], LAYER_IDS)) < 1e-4
    sample = next(iter(got.values()))
    path = write_sample(tmp_path / "s.safetensors", sample)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["vllm_version"] == vllm.__version__ and meta["model_runner"] == "v1"
    assert meta["model"] == str(tiny_llama) and meta["layer_ids"] == "1,2,4"
