"""What this host's CPU offers vLLM's CPU build: instruction sets, and the hybrid state dtype they imply.

vLLM's CPU platform reads the instruction sets through torch's CPUID probes to pick
kernels. They decide the SSM state dtype of hybrid models, and with it their attention
block size. Pure reading, no vLLM import."""

from __future__ import annotations

import torch


def cpu_isa() -> str:
    """The widest of AMX, AVX-512 BF16, AVX-512, AVX2 this CPU has, as vLLM's CPU build sees it.

    vLLM reads them with ``torch.cpu._is_*_supported``; elsewhere this is the machine name."""
    probes = (
        ("AMX", "_is_amx_tile_supported"),
        ("AVX-512 BF16", "_is_avx512_bf16_supported"),
        ("AVX-512", "_is_avx512_supported"),
        ("AVX2", "_is_avx2_supported"),
    )
    for name, probe in probes:
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and fn():
            return name
    import platform

    return platform.machine() or "unknown"


def cpu_ssm_state_is_float32() -> bool:
    """Whether vLLM's CPU platform keeps a hybrid model's SSM (recurrent) state in float32.

    It does when the CPU has AVX-512 BF16 (its accelerated gated-delta-net kernels),

    unless the user pins a 16-bit state dtype. Otherwise the state takes the model's dtype."""
    return bool(torch.cpu._is_avx512_bf16_supported())
