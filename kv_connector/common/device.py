"""Which GPU a thread works on: ``on_device`` at the start of every thread that touches
a CUDA cache or drives a NIXL agent holding a VRAM registration.

A new Python thread has no CUDA device of its own: its first CUDA call makes a context on
GPU 0, whatever the rank's GPU is (a stray context, and memory, on another rank's GPU),
and UCX, finding no valid CUDA context in the thread that posts a transfer, turns CUDA
IPC off for it (vLLM's NixlConnector sets the device in its threads for that reason).
"""

from __future__ import annotations

import torch


def on_device(device: torch.device | None) -> None:
    """Make ``device`` this thread's CUDA device when it is a GPU; nothing for a host
    device (a CPU cache never initializes CUDA)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
