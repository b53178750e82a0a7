"""Intel AMX permission for a vLLM process on CPU: ``request_amx()`` before its first kernel.

Linux enables AMX tile data per process only after ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``; a tile instruction before that raises SIGILL. vLLM 0.32's CPU
attention (``cpu_attention::AttentionImpl<ISA::AMX>``, chosen for bf16 from the CPU's
flags alone) runs tile instructions without asking: it relies on oneDNN, whose
``amx::is_available()`` asks the first time a oneDNN AMX kernel is built. With eager
execution (no warm-up pass), a model whose weights take the sgl-kernel GEMM and a first
batch of at most 4 tokens (that GEMM's threshold for AMX), attention is the first AMX
code to run, and the worker dies by SIGILL. Asking once when the process starts closes
that gap; the permission is the process's, so every thread started later has it.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import logging
import os
import platform
import threading
from pathlib import Path

log = logging.getLogger("kv_connector.amx")

# x86-64
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


class AmxPermission(enum.Enum):
    # the process may run tile instructions
    GRANTED = "granted"
    # the CPU (or the kernel) offers no AMX: nothing to ask
    NO_AMX = "no AMX"
    # the kernel said no (its errno is logged)
    REFUSED = "refused"


_lock = threading.Lock()
_result: AmxPermission | None = None


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """Whether the CPU reports AMX tiles (``amx_tile`` among /proc/cpuinfo's flags)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return "amx_tile" in line.split(":", 1)[-1].split()
    return False


def _arch_prctl(code: int, arg: int) -> int:
    """``syscall(SYS_arch_prctl, code, arg)``: 0, or -errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    rc = int(libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), ctypes.c_ulong(arg)))
    return 0 if rc == 0 else -ctypes.get_errno()


def _x86_linux() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def amx_permitted() -> bool:
    """Whether this process may run AMX tile instructions now."""
    if not _x86_linux():
        return False
    mask = ctypes.c_uint64(0)
    if _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.addressof(mask)) != 0:
        return False
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)


def request_amx() -> AmxPermission:
    """Ask the kernel for AMX tile data for this process, once; what it said.

    Safe anywhere: without AMX (other CPUs, other architectures, kernels before 5.16) it
    asks nothing. ``KV_CONNECTOR_REQUEST_AMX=0`` turns it off."""
    global _result
    with _lock:
        if _result is not None:
            return _result
        off = os.environ.get("KV_CONNECTOR_REQUEST_AMX", "1") == "0"
        _result = _ask() if _x86_linux() and cpu_has_amx() and not off else AmxPermission.NO_AMX
        return _result


def _ask() -> AmxPermission:
    rc = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if rc == 0:
        log.debug("AMX tile data permitted for process %d", os.getpid())
        return AmxPermission.GRANTED
    # a kernel or CPU without AMX tile data
    if rc in (-errno.EINVAL, -errno.EOPNOTSUPP):
        return AmxPermission.NO_AMX
    # ENOSPC: a thread's signal stack is too small for AMX's signal frame
    log.warning(
        "the kernel refused AMX tile data to process %d (%s): vLLM's AMX kernels may die by SIGILL",
        os.getpid(),
        errno.errorcode.get(-rc, str(-rc)),
    )
    return AmxPermission.REFUSED
