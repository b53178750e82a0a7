"""Fixtures for e2e tests: a tiny random model built on the spot, its transformers
reference, and a way to run a real vLLM producer in its own process."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kv_connector.reader import HiddenStatesReader, ReaderConfig, Sample
from kv_connector.wire.provenance import Expectation
from scripts.support.deaths import explain, program_env
from tests.engines import STARTS, Engines, EngineSpec, Run, SharedProducer, Start, producer_main

REPO = Path(__file__).resolve().parents[2]

# The tiny Llama's shared in-process push engine: fp32, every layer captured (4: the last
# layer's output before the norm), chunked prefill (256 tokens a step), prefix caching on
LLAMA_LAYERS = [1, 2, 3, 4]
LLAMA_BLOCK = 128


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every e2e test executes a model: skipped, with the reason, where the vLLM on the
    path has no compiled kernels (vLLM 0.33.0's Python code of ``make test-vllm033``)."""
    import importlib.util

    if importlib.util.find_spec("vllm._C") is not None:
        return
    import vllm

    skip = pytest.mark.skip(
        reason=f"vLLM {vllm.__version__} at {Path(vllm.__file__).parent} has no compiled kernels "
        "(Python code only, as make test-vllm033 fetches it): it cannot execute a model"
    )
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scripts.support.make_tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", seed=0)


class Reference:
    """The transformers model's hidden states, fp32: ``output_hidden_states[k]`` for
    k < num_layers. For k == num_layers transformers returns the final norm's output,
    while vLLM captures the last decoder layer's output before that norm (what EAGLE-3
    drafters train on), so the reference takes it from a hook on the last layer."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.num_layers = self.model.config.num_hidden_layers

    @torch.no_grad()
    def states(self, token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
        last: list[torch.Tensor] = []
        layer = self.model.model.layers[-1]
        hook = layer.register_forward_hook(
            lambda mod, args, out: last.append(out[0] if isinstance(out, tuple) else out)
        )
        try:
            # no cache: transformers builds none for a model without attention layers
            out = self.model(torch.tensor([token_ids]), output_hidden_states=True, use_cache=False)
        finally:
            hook.remove()
        rows = [last[0][0] if k == self.num_layers else out.hidden_states[k][0] for k in layer_ids]
        return torch.stack(rows, dim=1)


@pytest.fixture(scope="session")
def llama_reference(tiny_llama: Path) -> Reference:
    return Reference(tiny_llama)


@pytest.fixture
def llama_push(request: pytest.FixtureRequest, engines: Engines, tiny_llama: Path) -> SharedProducer:
    """The tiny Llama's shared in-process push engine (``LLAMA_LAYERS``, block 128, 256
    tokens a step, prefix caching on), its reader expecting exactly its samples."""
    spec = EngineSpec.of(
        tiny_llama,
        LLAMA_LAYERS,
        block_size=LLAMA_BLOCK,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
    )
    expect = Expectation(layer_ids=LLAMA_LAYERS, dtype="float32", hidden_size=128, model=tiny_llama.name)
    return engines.get(spec, request.fixturename, ReaderConfig(expect=expect))


@pytest.fixture
def pull_server(
    request: pytest.FixtureRequest,
    engines: Engines,
    tiny_llama: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    """The tiny Llama's OpenAI server in pull delivery (``common.LAYER_IDS``, block 128; a
    sample nobody fetches is held ``common.PULL_TIMEOUT_S``), shared by the tests that train
    speculators from it: a ``tests.e2e.api_server.ApiServer``."""
    from tests.e2e.common import BLOCK, LAYER_IDS, PULL_TIMEOUT_S

    extra = {"delivery": "pull", "pull_timeout_s": PULL_TIMEOUT_S}
    spec = EngineSpec.server(tiny_llama, LAYER_IDS, extra, block_size=BLOCK)
    return engines.server(spec, tmp_path_factory.getbasetemp() / "pull-server", request.fixturename)


def producer_command(spec: EngineSpec, run: Run, address: str) -> list[str]:
    """tests/e2e/producer_main.py's command line: one run on an engine of ``spec`` shipping to
    ``address``."""
    return producer_main(json.dumps({**spec.as_spec(address), **run.as_json()}))


def run_producer(
    spec: EngineSpec, run: Run, address: str, timeout: float = 600, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``run`` on an engine of its own (``spec``, shipping to ``address``), to the end;
    producer_main.py's JSON result with ``rc``, ``stderr`` and ``log``."""
    STARTS.count("producer", Start.FRESH)
    proc = subprocess.run(
        producer_command(spec, run, address),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=program_env({**dict(spec.env), **(env or {})}),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    result["rc"] = proc.returncode
    result["stderr"] = proc.stderr
    result["log"] = proc.stdout + proc.stderr  # vLLM's log lines (and ours) go to stdout
    if why := explain(result["log"], proc.returncode, "producer"):
        print(why)
    return result


def start_producer(
    spec: EngineSpec, run: Run, address: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``run`` on an engine of its own (``spec``, shipping to ``address``), started."""
    STARTS.count("producer", Start.FRESH)
    return subprocess.Popen(
        producer_command(spec, run, address),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=program_env({**dict(spec.env), **(env or {})}),
    )


def run_and_collect(
    reader: HiddenStatesReader, spec: EngineSpec, run: Run, n: int, env: dict[str, str] | None = None
) -> tuple[dict[str, Sample], dict[str, Any], str]:
    """``run`` on an engine of its own (``spec``) shipping to ``reader``: take n samples
    (each exactly once), wait for the producer, and check no extra sample follows; returns
    (samples by request id, its JSON result, its log)."""
    proc = start_producer(spec, run, reader.address, env=env)
    got: dict[str, Sample] = {}
    try:
        while len(got) < n:
            try:
                s = reader.get(timeout=5, copy=True)  # kept for the checks: a copy
            except TimeoutError:
                if proc.poll() is not None:
                    break
                continue
            assert s.request_id not in got, f"{s.request_id} delivered twice"
            got[s.request_id] = s
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    why = explain(out + err, proc.returncode, "producer")
    assert proc.returncode == 0 and len(got) == n, (proc.returncode, why, len(got), err[-5000:], out[-3000:])
    result = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    with pytest.raises(TimeoutError):
        extra = reader.get(timeout=1.0)
        pytest.fail(f"unexpected extra sample {extra.request_id}")
    return got, result, out + err


def check_samples(
    got: dict[str, Sample],
    result: dict[str, Any],
    prompts: list[list[int]],
    ref: Reference,
    layer_ids: list[int],
    with_output: set[int],
    dtype: torch.dtype = torch.float32,
    tolerance: float = 1e-4,
    token_tolerance: float | None = None,
    hidden_size: int = 128,
) -> float:
    """Every request's sample, against the transformers reference: its tokens (the
    prompt, plus all output tokens but the last for ``with_output``), its layers, shape
    and dtype, no all-zero token, and a relative error below ``tolerance`` for the whole
    sample (and below ``token_tolerance`` for each token, where given: a zero or foreign
    row is off by ~1 or more); its kv_transfer_params name it. Returns the worst error."""
    worst = 0.0
    assert {o["request_id"] for o in result["outputs"]} == set(got)
    for i, (o, prompt) in enumerate(zip(result["outputs"], prompts, strict=True)):
        s = got[o["request_id"]]
        tokens = prompt + o["output_token_ids"][:-1] if i in with_output else prompt
        assert s.token_ids.tolist() == tokens
        assert s.layer_ids == tuple(layer_ids)
        assert s.hidden_states.shape == (len(tokens), len(layer_ids), hidden_size)
        assert s.hidden_states.dtype == dtype
        assert bool((s.hidden_states.float().abs().sum(dim=(1, 2)) > 0).all()), (i, "all-zero token states")
        want = ref.states(tokens, layer_ids)
        if token_tolerance is not None:
            got_f = s.hidden_states.float()
            per_token = (got_f - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2))
            assert float(per_token.max()) < token_tolerance, (i, len(tokens), int(per_token.argmax()))
        err = relative_error(s.hidden_states, want)
        assert err < tolerance, (i, len(tokens), err)
        worst = max(worst, err)
        params = o["kv_transfer_params"]["hidden_states"]
        assert params["consumer_address"] and params["request_id"] == s.request_id
    return worst


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    """Deterministic random prompts of the given lengths (token ids 1..1023)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 1024) for _ in range(n)] for n in lengths]


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny hybrid Qwen3-Next (bf16, linear-attention head dim 128: what vLLM's CPU
    build runs), random weights."""
    from scripts.support.make_tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny-qwen3-next"
    return build_tiny_model(out, "qwen3_next", seed=0, dtype="bfloat16")


@pytest.fixture(scope="session")
def qwen3_next_reference(tiny_qwen3_next: Path) -> Reference:
    return Reference(tiny_qwen3_next)


HYBRID_ENTRY_POINT = "hybrid.plugin:register"


@pytest.fixture(scope="session")
def hybrid_plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment under which vLLM, in every process it starts, finds the hybrid plugin
    the way it finds any plugin: a ``vllm.general_plugins`` entry point. Until the
    installed package declares it, a dist-info directory on PYTHONPATH declares it."""
    from importlib.metadata import entry_points

    path = [str(REPO)]
    if not any(ep.value == HYBRID_ENTRY_POINT for ep in entry_points(group="vllm.general_plugins")):
        site = tmp_path_factory.mktemp("plugin-site")
        info = site / "kv_hidden_states_hybrid_test-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: kv-hidden-states-hybrid-test\nVersion: 0.0\n"
        )
        (info / "entry_points.txt").write_text(
            f"[vllm.general_plugins]\nhybrid_supplementary = {HYBRID_ENTRY_POINT}\n"
        )
        path.append(str(site))
    return {"PYTHONPATH": os.pathsep.join(path), "HIDDEN_STATES_SUPPLEMENTARY": "1"}
