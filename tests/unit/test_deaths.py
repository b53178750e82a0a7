"""``scripts.support.deaths``: how a vLLM process died, in words, for every launcher's
failure message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from scripts.support.deaths import FAULT_ENV, deaths, exit_status, explain

WORKER_LOG = (
    "INFO 11-28 [core.py:95] Initializing a V1 LLM engine\n"
    "ERROR 11-28 [multiproc_executor.py:316] Worker proc VllmWorker-0 died unexpectedly "
    "(exit code: -4), shutting down executor.\n"
    "ERROR 11-28 [multiproc_executor.py:316] Worker proc VllmWorker-0 died unexpectedly "
    "(exit code: -4), shutting down executor.\n"
    "RuntimeError: Process EngineCore_DP0 (PID: 4242) died with exit code -9\n"
)


def test_a_workers_signal_is_named_from_vllms_log() -> None:
    assert deaths(WORKER_LOG) == [
        "VllmWorker-0: SIGILL (Illegal instruction)",
        "EngineCore_DP0: SIGKILL (Killed)",
    ]
    assert deaths("INFO all well\n") == []


def test_exit_codes_in_words() -> None:
    assert exit_status(0) == "exit status 0"
    assert exit_status(3) == "exit status 3"
    assert exit_status(-11) == "SIGSEGV (Segmentation fault)"
    assert exit_status(-200) == "signal 200"


def test_explain_names_the_process_itself_and_nothing_when_nothing_died() -> None:
    assert explain("", -4, "server") == "died: server: SIGILL (Illegal instruction)"
    assert explain(WORKER_LOG, 1, "producer").startswith("died: VllmWorker-0: SIGILL")
    assert explain("INFO fine\n", 0) == ""


def test_a_process_killed_by_sigill_is_named_and_dumps_its_threads() -> None:
    code = "import os, signal, threading; threading.Event(); os.kill(os.getpid(), signal.SIGILL)"
    env = {**os.environ, **FAULT_ENV}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == -signal.SIGILL
    assert explain(proc.stderr, proc.returncode, "worker") == "died: worker: SIGILL (Illegal instruction)"
    assert "Fatal Python error: Illegal instruction" in proc.stderr  # faulthandler's dump
