"""Fixtures for e2e tests: a tiny random model built on the spot, its transformers
reference, and a way to run a real vLLM producer in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scripts.make_tiny_model import build_tiny_model

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
            out = self.model(torch.tensor([token_ids]), output_hidden_states=True)
        finally:
            hook.remove()
        rows = [last[0][0] if k == self.num_layers else out.hidden_states[k][0] for k in layer_ids]
        return torch.stack(rows, dim=1)


@pytest.fixture(scope="session")
def llama_reference(tiny_llama: Path) -> Reference:
    return Reference(tiny_llama)


def run_producer(
    spec: dict[str, Any], timeout: float = 600, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run tests/e2e/producer_main.py; return its JSON result (rc and stderr included)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "e2e" / "producer_main.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    result["rc"] = proc.returncode
    result["stderr"] = proc.stderr
    return result


def start_producer(spec: dict[str, Any], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "e2e" / "producer_main.py"), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})},
    )


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())
