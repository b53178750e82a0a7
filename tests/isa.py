"""Both kinds of x86 CPU these tests run on, for code that only *reads* the CPU.

vLLM's CPU build reads the instruction set through torch's CPUID probes
(``torch.cpu._is_avx512_bf16_supported``, ``_is_amx_tile_supported``) and derives
configuration from it: with AVX-512 BF16 a hybrid model's SSM state is float32 (its
accelerated gated-delta-net kernels), which makes the attention block larger. No
environment variable or option makes vLLM take its AVX2 path on an AVX-512 machine (the
kernel library and the attention ISA are chosen from the same probes), so a test of
*configuration* arithmetic answers the probes both ways with ``as_if_cpu``; nothing that
runs a kernel may use it (the kernels loaded are the host's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

KINDS = {"avx2": False, "avx512_bf16_amx": True}


@contextmanager
def as_if_cpu(kind: str) -> Iterator[None]:
    """Make vLLM's configuration code see a CPU of ``kind`` ("avx2" or "avx512_bf16_amx")."""
    wide = KINDS[kind]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: wide)
        mp.setattr(torch.cpu, "_is_amx_tile_supported", lambda: wide)
        yield


def host_kind() -> str:
    return "avx512_bf16_amx" if torch.cpu._is_avx512_bf16_supported() else "avx2"
