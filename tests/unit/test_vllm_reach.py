"""The unit pass on vLLM 0.33 keeps the test modules that reach vLLM's code
(``tests/vllm_reach.py``): one whose imports lead, at any depth and inside functions too,
to a module that imports vllm; not one whose imports never do."""

from __future__ import annotations

from pathlib import Path

from tests.vllm_reach import REPO, reaches_vllm


def test_a_module_counts_when_its_imports_lead_to_vllm_and_not_otherwise(tmp_path: Path) -> None:
    deep = tmp_path / "test_deep.py"  # worker_side imports vllm inside its functions only
    deep.write_text("from kv_connector.producer.worker_side import WorkerSide\n")
    pure = tmp_path / "test_pure.py"
    pure.write_text("from kv_connector.wire import protocol\nfrom kv_connector.sender.ledger import *\n")
    inner = tmp_path / "test_inner.py"  # an import inside a test function counts too
    inner.write_text("def test_x():\n    from kv_connector import connector\n")
    assert reaches_vllm(deep) and reaches_vllm(inner)
    assert not reaches_vllm(pure)
    assert reaches_vllm(REPO / "tests/unit/producer/test_modes.py")
    assert not reaches_vllm(REPO / "tests/unit/wire/test_protocol.py")
