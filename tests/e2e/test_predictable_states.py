"""States whose every value says where it came from: a wrong layer, token or block is
caught by value, exactly, not by a tolerance.

The model is a standard Llama (no custom vLLM model) whose weights make its residual
stream predictable: every attention and MLP weight and bias is zero but the MLPs' down
projection bias, ``LAYER_STEP``, and the embedding of token t is ``t * TOKEN_STEP + d`` in
dimension d. So after k decoder layers (vLLM's layer id k, ``output_hidden_states[k]``)
token t holds ``t * TOKEN_STEP + k * LAYER_STEP + d``, an integer far below 2**24 and so
exact in fp32, from which token, layer and dimension read back unambiguously.

One batch of prompts with distinct token ids (so a position is named by its token),
chunked prefill under a 128-token budget, a 32-token block pinned in the config
(prompts cross many block and chunk boundaries), unsorted layer ids, one request with
its output tokens: every value of every sample must be the one its position, its
label and its dimension predict. (The LM head is zero, so greedy output tokens are all
token 0: they name their layer, not their position.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kv_connector.reader import HiddenStatesReader, Sample
from tests.e2e.conftest import run_and_collect
from tests.engines import EngineSpec, Run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HIDDEN = 128
NUM_LAYERS = 6
VOCAB = 4096
LAYER_STEP = HIDDEN  # each layer adds this to every dimension
TOKEN_STEP = HIDDEN * (NUM_LAYERS + 1)  # so t, k and d never overlap: exact decoding
LAYER_IDS = [6, 0, 3, 4]  # unsorted on purpose: the labels must follow the states
BLOCK = 32
BUDGET = 128
LENGTHS = [300, 161, 33, 1, 64, 97]
WITH_OUTPUT = 2  # this prompt also ships its output tokens
MAX_TOKENS = [1, 2, 4, 1, 3, 1]


def build_predictable_llama(out: Path) -> Path:
    """A Llama whose input of layer k at token t is ``t * TOKEN_STEP + k * LAYER_STEP + d``
    in dimension d, exactly, in transformers and in vLLM alike."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        mlp_bias=True,  # the only bias a layer adds to the residual stream
    )
    config.torch_dtype = "float32"
    model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.zero_()
        token = torch.arange(VOCAB, dtype=torch.float32)[:, None]
        model.model.embed_tokens.weight.copy_(token * TOKEN_STEP + torch.arange(HIDDEN))
        for layer in model.model.layers:
            layer.mlp.down_proj.bias.fill_(float(LAYER_STEP))
    model.save_pretrained(out, safe_serialization=True)
    return out


def expected(token_ids: list[int], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """[tokens, layers, hidden]: what each value must be for these tokens and labels."""
    t = torch.tensor(token_ids, dtype=torch.float32)[:, None, None]
    k = torch.tensor(layer_ids, dtype=torch.float32)[None, :, None]
    return t * TOKEN_STEP + k * LAYER_STEP + torch.arange(HIDDEN, dtype=torch.float32)


def decode(value: float) -> tuple[int, int, int]:
    """(token id, layer id, dimension) that wrote ``value``."""
    v = int(value)
    return v // TOKEN_STEP, (v % TOKEN_STEP) // LAYER_STEP, v % LAYER_STEP


def first_wrong(s: Sample, want: torch.Tensor, place: dict[int, tuple[int, int]]) -> str:
    """The first wrong value of ``s``, read back: whose token, layer and dimension it is."""
    got = s.hidden_states.float()
    t, i, d = (int(x) for x in torch.nonzero(got != want)[0])
    token, layer, dim = decode(float(got[t, i, d]))
    return (
        f"{s.request_id} position {t}, slot {i} (labelled layer {s.layer_ids[i]}), dim {d}: "
        f"holds token {token} (prompt, position {place.get(token)}), layer {layer}, dim {dim}; "
        f"want token {int(s.token_ids[t])}, layer {s.layer_ids[i]}, dim {d}"
    )


@pytest.fixture(scope="module")
def predictable_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_predictable_llama(tmp_path_factory.mktemp("models") / "predictable-llama")


@pytest.mark.fresh_engine("a model whose weights make every value predictable")
def test_every_value_names_its_token_and_layer(predictable_llama: Path) -> None:
    ids = random.Random(7).sample(range(1, VOCAB), sum(LENGTHS))  # distinct: a token names its place
    prompts, at = [], 0
    for n in LENGTHS:
        prompts.append(ids[at : at + n])
        at += n
    with HiddenStatesReader() as reader:
        spec = EngineSpec.of(predictable_llama, LAYER_IDS, block_size=BLOCK, max_num_batched_tokens=BUDGET)
        # an in-process engine ships output tokens on a later step: drain_steps
        run = Run(prompts, max_tokens=MAX_TOKENS, with_output=[WITH_OUTPUT], drain_steps=3)
        got, result, _ = run_and_collect(reader, spec, run, len(prompts))
    place = {tok: (p, pos) for p, prompt in enumerate(prompts) for pos, tok in enumerate(prompt)}
    for i, (o, prompt) in enumerate(zip(result["outputs"], prompts, strict=True)):
        s = got[o["request_id"]]
        tokens = prompt + o["output_token_ids"][:-1] if i == WITH_OUTPUT else prompt
        assert s.token_ids.tolist() == tokens
        assert sorted(s.layer_ids) == sorted(LAYER_IDS), s.layer_ids
        assert s.hidden_states.shape == (len(tokens), len(LAYER_IDS), HIDDEN)
        assert s.hidden_states.dtype == torch.float32
        want = expected(tokens, s.layer_ids)
        if not torch.equal(s.hidden_states, want):
            pytest.fail(first_wrong(s, want, place))
