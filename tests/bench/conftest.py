"""The benchmark's own tests (its arms at tiny sizes, the pairing, the summary): an arm
that executes a model is skipped, as the e2e tests are, where the vLLM on the path has no
compiled kernels (vLLM 0.33.0's Python code of ``make test-vllm033``)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("vllm._C") is not None:
        return
    import vllm

    skip = pytest.mark.skip(
        reason=f"vLLM {vllm.__version__} at {Path(vllm.__file__).parent} has no compiled kernels "
        "(Python code only, as make test-vllm033 fetches it): it cannot execute a model"
    )
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent) and item.get_closest_marker("e2e"):
            item.add_marker(skip)
