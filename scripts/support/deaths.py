"""How a vLLM process died, named: the signal that killed a worker, an engine core or the
process a test started, read from exit codes and vLLM's log. Every launcher of vLLM in the
tests and benchmarks appends ``explain(...)`` to what it reports on failure, and starts
vLLM with ``FAULT_ENV``, so a fatal signal also dumps every thread's Python frames.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Python's faulthandler: on SIGSEGV, SIGFPE, SIGABRT, SIGBUS and SIGILL, the frames of
# every thread go to stderr (inherited by vLLM's engine core and workers)
FAULT_ENV = {"PYTHONFAULTHANDLER": "1"}


def program_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a program a benchmark or a test starts (a vLLM server, a producer):
    this process's, one OpenMP thread, ``FAULT_ENV``, the repository on the path, then ``extra``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **FAULT_ENV, "PYTHONPATH": str(REPO), **(extra or {})}


# vLLM's lines for a child that died: "Worker proc VllmWorker-0 died unexpectedly (exit
# code: -4)" (multiproc executor), "Process EngineCore_DP0 (PID: 7) died with exit code -9"
_DIED = [
    re.compile(r"Worker proc (?P<name>\S+) died unexpectedly \(exit code: (?P<code>-?\d+)\)"),
    re.compile(r"Process (?P<name>\S+) \(PID: \d+\) died with exit code (?P<code>-?\d+)"),
]


def exit_status(code: int) -> str:
    """An exit code in words: a negative one (killed by a signal) names the signal."""
    if code >= 0:
        return f"exit status {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"signal {-code}"
    return f"{sig.name} ({signal.strsignal(sig) or sig.name})"


def deaths(log: str) -> list[str]:
    """Each process vLLM's log says died, with how: ``VllmWorker-0: SIGILL (Illegal
    instruction)``; once each, in order."""
    out: list[str] = []
    for pattern in _DIED:
        for m in pattern.finditer(log):
            line = f"{m['name']}: {exit_status(int(m['code']))}"
            if line not in out:
                out.append(line)
    return out


def explain(log: str, returncode: int | None = None, name: str = "process") -> str:
    """One paragraph for a failure message: how ``name`` ended and which of vLLM's
    processes died by what; "" when nothing died."""
    parts = []
    if returncode is not None and returncode < 0:
        parts.append(f"{name}: {exit_status(returncode)}")
    parts += deaths(log)
    return "died: " + "; ".join(parts) if parts else ""
