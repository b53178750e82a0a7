"""``make bench`` stopped in an arm (a CI limit, ``timeout``, Ctrl-C: SIGTERM to its whole
process group) leaves no process behind: the arm's vLLM OpenAI server, in a session of its
own, and the engine it started go with it, and the benchmark says it was stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from scripts.support.deaths import program_env
from tests.e2e.common import speculators_site
from tests.engines import STARTS, Start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENGINE_UP_S = 300.0  # the arm's server reaches its engine core within this on a slow host


@pytest.mark.fresh_engine("the benchmark's own server, stopped with it")
def test_the_benchmark_stopped_in_an_arm_leaves_no_process_behind() -> None:
    speculators_site()  # the keep arm's trainers need it
    STARTS.count("openai server", Start.FRESH)  # the arm's own
    bench = subprocess.Popen(
        [sys.executable, "-m", "scripts.bench", "--only", "keep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=program_env(),
        start_new_session=True,  # a group of its own, as ``timeout`` makes one
    )
    seen: dict[int, str] = {}  # every process under the benchmark, by pid
    try:
        deadline = time.monotonic() + ENGINE_UP_S
        while not any("EngineCore" in name for name in seen.values()):
            assert bench.poll() is None, bench.communicate()[0][-4000:]
            assert time.monotonic() < deadline, f"no vLLM engine under the benchmark: {seen}"
            for p in psutil.Process(bench.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    seen[p.pid] = " ".join(p.cmdline()) or p.name()
            time.sleep(0.5)
        os.killpg(bench.pid, signal.SIGTERM)  # what ``timeout`` does
        out, _ = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.communicate()
    assert any("vllm.entrypoints.openai.api_server" in c for c in seen.values()), seen
    gone_by = time.monotonic() + 60
    while (left := {pid: c for pid, c in seen.items() if psutil.pid_exists(pid) and _alive(pid)}) and (
        time.monotonic() < gone_by
    ):
        time.sleep(0.5)
    assert not left, f"still running after the benchmark was stopped: {left}"
    assert bench.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped (stopped by SIGTERM)" in out, out[-3000:]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
