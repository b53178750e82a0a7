"""What every test shares: Hypothesis' settings, and the running vLLM engines.

Hypothesis times the machine by default: an example slower than 200 ms fails its test, and so
does a strategy slow to draw (``HealthCheck.too_slow``). On a slow or busy CI host both fail
tests whose logic is sound (a draw of three integers once took 2.27 s there). These tests check
what the code does; its speed is the benchmarks' to show. So neither timing applies here.

Engines are shared by configuration (``tests.engines``): ``engines`` holds them, an engine
stops after the last test that uses its fixture, a test that fails retires the ones it used,
and the run's end prints how many engines the tests started.

``make test`` runs the suite on pytest-xdist's workers (``--dist loadfile``: a module's tests
run on one worker, so a module's shared engine starts once), and the workers' engine counts
are summed at the end. Tests marked ``alone`` (a time bound a busy machine stretches) run
afterwards, by themselves.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.engines import FAILED, STARTS, Engines, Start

MODULE_SECONDS = Path(__file__).parent / "module_seconds.json"  # scripts/support/module_seconds.py
LAST_USER: dict[str, str] = {}  # fixture name -> node id of the last collected test using it

settings.register_profile("machine_independent", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("machine_independent")


@pytest.fixture(scope="session")
def engines() -> Iterator[Engines]:
    """The shared vLLM engines, by spec (``engines.get``, ``engines.server``)."""
    engines = Engines(LAST_USER)
    try:
        yield engines
    finally:
        engines.close()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """On the unit pass on vLLM 0.33 (``VLLM_REACH_ONLY=1``), a test module that does not
    reach vLLM's code is not even imported (``tests/vllm_reach.py``)."""
    if os.environ.get("VLLM_REACH_ONLY") != "1" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    from tests.vllm_reach import reaches_vllm

    return None if reaches_vllm(collection_path) else True


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first (``tests/module_seconds.json``), a module's tests in their
    order: pytest-xdist's workers (``--dist loadfile --no-loadscope-reorder``) take modules
    in this order, so the run does not end on a long module started last. Then each
    fixture's last test, so that its shared engine stops after it (``Engines``)."""
    table: dict[str, float] = json.loads(MODULE_SECONDS.read_text())
    items.sort(key=lambda item: -table.get(item.nodeid.split("::", 1)[0], 0.0))
    LAST_USER.clear()
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            LAST_USER[name] = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test that failed retires the shared engines it used (what it left in them is
    unknown; ``FAILED`` in its stash says so to other shared processes); after its last
    test, an engine stops."""
    report = yield
    if report.failed:
        item.stash[FAILED] = True
    engines = getattr(item, "funcargs", {}).get("engines")
    if isinstance(engines, Engines):
        if report.failed:
            engines.retire_used()
        if report.when == "teardown":
            engines.test_done(item.nodeid)
    return report


class _WorkerStarts:
    """pytest-xdist: each worker sends its engine counts, the controller adds them up."""

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        out = getattr(session.config, "workeroutput", None)
        if out is not None:
            out["engine_starts"] = STARTS.dump()

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        STARTS.merge(getattr(node, "workeroutput", {}).get("engine_starts"))


def pytest_configure(config: pytest.Config) -> None:
    from scripts.support.vllm_server import VllmServer

    config.pluginmanager.register(_WorkerStarts(), "engine-starts")
    # every OpenAI server a test starts in this process (its own, a shared one, a bench arm's)
    VllmServer.on_start.append(lambda s: STARTS.count("openai server", getattr(s, "start_kind", Start.FRESH)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """The test running now, for the engine count's check of ``fresh_engine``."""
    STARTS.test = item
    try:
        return (yield)
    finally:
        STARTS.test = None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if lines := STARTS.report():
        terminalreporter.section("vLLM engines (tests.engines)")
        for line in lines:
            terminalreporter.write_line(line)
