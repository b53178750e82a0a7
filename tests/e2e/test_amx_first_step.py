"""A worker whose first step is a prompt of at most 4 tokens, in bf16: the shape that killed
vLLM's CPU worker by SIGILL on AVX-512 + AMX machines.

vLLM's CPU attention runs AMX tile instructions without asking Linux for them; oneDNN asks
when it builds its first AMX kernel. A tiny bf16 model's linear layers take the sgl-kernel
GEMM, which uses AMX (through oneDNN) only above 4 tokens, and eager execution runs no
warm-up pass: so a first batch of 1 to 4 tokens reached attention before anything had
asked, and the worker died. Our vLLM plugin (``kv_connector.vllm_plugin``) asks in every
vLLM process before its first forward. Each run below is a fresh engine (the permission
is the process's), with the reader absent (the request runs without shipping) and
present (it ships); on CPUs without AMX the same runs pass for the same reasons, and the
first test shows which case the machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kv_connector.common.amx import cpu_has_amx
from kv_connector.reader import HiddenStatesReader
from tests.e2e.conftest import REPO, Reference, prompts_of, relative_error, run_and_collect, run_producer
from tests.engines import EngineSpec, Run
from tests.ports import address_of, held_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYER_IDS = [1, 2, 4]
BLOCK = 128


@pytest.fixture(scope="module")
def tiny_llama_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scripts.support.make_tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-llama-bf16", "llama", seed=0, dtype="bfloat16"
    )


def test_vllms_plugin_loader_gives_every_process_amx_before_its_first_forward() -> None:
    """What a vLLM worker does at start (``load_general_plugins``), in a process that has
    run nothing else: afterwards it holds the AMX permission exactly where the CPU has AMX."""
    code = (
        "import json; from kv_connector.common.amx import amx_permitted; before = amx_permitted(); "
        "from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "print(json.dumps({'before': before, 'after': amx_permitted()}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    print(f"AMX on this CPU: {cpu_has_amx()}; permission {got}")
    assert got == {"before": False, "after": cpu_has_amx()}


def spec(model: Path, **extra: object) -> EngineSpec:
    return EngineSpec.of(model, LAYER_IDS, extra, block_size=BLOCK, dtype="bfloat16")


@pytest.mark.fresh_engine("the first step of a new process (vLLM sets AMX up once a process)")
@pytest.mark.parametrize("tokens", [1, 4])
def test_a_first_step_of_few_bf16_tokens_without_a_reader_runs(tiny_llama_bf16: Path, tokens: int) -> None:
    prompts = prompts_of([tokens], seed=48)
    with held_port() as held:  # nobody listens: the request runs without shipping
        res = run_producer(spec(tiny_llama_bf16, connect_timeout_s=1), Run(prompts), address_of(held))
    assert res["rc"] == 0, res["log"][-6000:]
    (out,) = res["outputs"]
    assert out["kv_transfer_params"]["hidden_states"]["status"] == "failed"  # no reader, said so
    assert len(out["output_token_ids"]) == 1  # the forward ran
    assert "runs without shipping its hidden states" in res["log"]


@pytest.mark.fresh_engine("the first step of a new process (vLLM sets AMX up once a process)")
def test_a_first_step_of_one_bf16_token_ships_its_states(tiny_llama_bf16: Path) -> None:
    prompts = prompts_of([1], seed=49)
    with HiddenStatesReader() as reader:
        got, _, _ = run_and_collect(reader, spec(tiny_llama_bf16), Run(prompts), 1)
    (sample,) = got.values()
    assert sample.token_ids.tolist() == prompts[0]
    want = Reference(tiny_llama_bf16).states(prompts[0], LAYER_IDS)
    assert sample.hidden_states.dtype == torch.bfloat16
    assert relative_error(sample.hidden_states, want) < 0.02
