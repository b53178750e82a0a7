"""Which NIXL wheel goes with this torch, and how to install it, in one line.

The ``nixl`` meta package imports ``nixl_cu{torch's CUDA major}``: vLLM 0.33 pins a CUDA
13 torch (nixl-cu13), vLLM 0.32's CUDA build a CUDA 12 one, and the CPU build takes
nixl-cu12. Pure: nothing here imports nixl, so the hint can be given where it is missing."""

from __future__ import annotations

import torch

NIXL_VERSION = "1.5.1"


def nixl_wheel(torch_cuda: str | None) -> str:
    """The NIXL wheel for a torch built against CUDA ``torch_cuda`` (``torch.version.cuda``,
    None for a CPU build). The CPU build's NIXL falls back to whichever backend is installed."""
    major = torch_cuda.split(".")[0] if torch_cuda else "12"
    return f"nixl-cu{major}"


def install_hint(torch_cuda: str | None) -> str:
    """How to install NIXL for this torch, in one line."""
    built = f"torch {torch.__version__} built for CUDA {torch_cuda}" if torch_cuda else "a CPU build of torch"
    return (
        f"pip install {nixl_wheel(torch_cuda)}=={NIXL_VERSION} && pip install --no-deps nixl=={NIXL_VERSION} "
        f"(for {built}; the nixl package loads nixl_cu<torch's CUDA major>: nixl-cu13 for vLLM 0.33, "
        "nixl-cu12 for vLLM 0.32)"
    )
