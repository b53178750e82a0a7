"""How the programs that start others (the benchmark and its arms, the demo, the GPU check's
stages) end them when they are stopped.

``raise_on_termination()``: SIGTERM and SIGHUP raise ``KeyboardInterrupt`` in the main thread,
as Ctrl-C does, so every ``with`` and ``finally`` that started a process stops it (by
default SIGTERM ends Python at once, and a child in a session of its own, such as vLLM's
server, is left behind with parent 1). ``ends_with_parent``: a ``preexec_fn`` that has the
kernel send the child SIGTERM when the process that started it dies, however it dies
(SIGKILL included); vLLM's server then stops its engine and workers itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Terminated(KeyboardInterrupt):
    """The program was told to stop (SIGTERM, SIGHUP): unwinds as Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def raise_on_termination() -> None:
    """SIGTERM and SIGHUP raise ``Terminated`` in the main thread (SIGINT already raises
    ``KeyboardInterrupt``). Call it first thing in a program's ``main``."""

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second signal ends the program at once
        raise Terminated(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def exit_status(e: Terminated) -> int:
    """The shell's status for a program ended by ``e``'s signal (143 for SIGTERM)."""
    return 128 + e.signum


def ends_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when this process
    (strictly: the thread that starts it) dies. None off Linux, where there is no such call."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody would signal
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
