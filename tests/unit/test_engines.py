"""The suite's engine bookkeeping (``tests.engines``), pure logic: specs key shared engines,
turn into a producer's spec and a server's flags; the count of starts refuses an unannounced
fresh engine and adds up the xdist workers' counts."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engines import EngineSpec, Run, Start, _Starts


def test_equal_configurations_are_one_key_and_any_difference_another() -> None:
    a = EngineSpec.of("/m", [1, 2, 4], {"delivery": "pull", "pull_timeout_s": 25})
    b = EngineSpec.of("/m", (1, 2, 4), {"pull_timeout_s": 25, "delivery": "pull"})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert len({a, EngineSpec.of("/m", [1, 2, 4], {"delivery": "pull"}), EngineSpec.of("/m", [1, 2])}) == 3
    assert EngineSpec.of("/m", [3, 1, 2]).layer_ids == (3, 1, 2)  # as given: vLLM sorts, the test checks


def test_a_spec_becomes_the_producers_spec_and_the_servers_flags() -> None:
    spec = EngineSpec.of("/m", [1, 4], {"checksum": "none"}, faults={1000: "zeros"}, block_size=16, tp=2)
    out = spec.as_spec("127.0.0.1:5")
    assert out["address"] == "127.0.0.1:5" and out["layer_ids"] == [1, 4] and out["tp"] == 2
    assert out["extra"] == {"checksum": "none"} and out["faults"] == {"1000": "zeros"}
    assert spec.as_cli_args() == [
        "--max-num-batched-tokens", "2048", "--max-num-seqs", "16", "--block-size", "16",
        "--tensor-parallel-size", "2", "--no-enable-prefix-caching",
    ]  # fmt: skip
    server = EngineSpec.server("/m", [1, 4], {"delivery": "pull"})  # the rest left to vLLM
    assert server.as_cli_args() == ["--block-size", "128"]
    run = Run([[1, 2], [3]], max_tokens=[2, 1], with_output=[0]).as_json()
    assert run["prompts"] == [[1, 2], [3]] and run["with_output"] == [0] and run["kv_params"] == []


class _Item:
    nodeid = "tests/x.py::test_x"

    def __init__(self, marked: bool) -> None:
        self.marked = marked

    def get_closest_marker(self, name: str) -> Any:
        return object() if self.marked and name == "fresh_engine" else None


def test_a_fresh_engine_must_be_announced_and_counts_add_up_across_workers() -> None:
    starts = _Starts()
    starts.test = _Item(marked=False)
    starts.count("producer", Start.SHARED)  # a shared one needs no word
    with pytest.raises(AssertionError, match="fresh_engine"):
        starts.count("producer", Start.FRESH)
    starts.test = _Item(marked=True)
    starts.count("producer", Start.FRESH)
    starts.reused = 3
    total = _Starts()
    total.merge(starts.dump())
    total.merge(starts.dump())
    assert total.counts[("producer", Start.SHARED)] == 2 and total.counts[("producer", Start.FRESH)] == 2
    assert total.reused == 6
    assert total.report()[0] == "vLLM engines started by the tests: 4; tests that found theirs running: 6"


def test_module_seconds_sum_a_modules_tests_over_runs_longest_first(tmp_path: Any) -> None:
    from scripts.support.module_seconds import module_seconds

    xml = (
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.e2e.test_a" name="x" time="1.5"/>'
        '<testcase classname="tests.e2e.test_a" name="y" time="2.0"/>'
        '<testcase classname="tests.unit.test_b" name="z" time="9.25"/>'
        "</testsuite></testsuites>"
    )
    (tmp_path / "one.xml").write_text(xml)
    (tmp_path / "two.xml").write_text(xml.replace("tests.unit.test_b", "tests.bench.test_c"))
    got = module_seconds([tmp_path / "one.xml", tmp_path / "two.xml"])
    assert got == {"tests/bench/test_c.py": 9.2, "tests/unit/test_b.py": 9.2, "tests/e2e/test_a.py": 7.0}
    assert list(got) == ["tests/bench/test_c.py", "tests/unit/test_b.py", "tests/e2e/test_a.py"]


def test_the_module_table_names_existing_modules_longest_first() -> None:
    """``tests/conftest.py`` orders the run by ``tests/module_seconds.json``: every entry
    names a module that exists (a renamed one would silently go last)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    table = json.loads((root / "tests" / "module_seconds.json").read_text())
    assert table and all((root / m).is_file() for m in table), [m for m in table if not (root / m).is_file()]
    assert list(table.values()) == sorted(table.values(), reverse=True)
