"""Which vLLM the suite ran on. ``make test`` runs the suite on the venv's vLLM (0.32.0,
the CPU build) and ``tests/unit`` again on vLLM 0.33.0's Python code
(``make test-vllm033``); each run names the release it expects in ``EXPECT_VLLM``, so a
run that silently imported the other vLLM fails here."""

from __future__ import annotations

import os

from hybrid.versions import SUPPORTED_VLLM, release


def test_runs_on_the_expected_vllm() -> None:
    import vllm

    found = release(vllm.__version__)
    assert found in SUPPORTED_VLLM
    expected = os.environ.get("EXPECT_VLLM")
    if expected:
        assert found == expected, f"expected vLLM {expected}, imported {vllm.__version__} ({vllm.__file__})"
