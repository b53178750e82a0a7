"""Which GPU a thread works on (``on_device``), and a tensor brought to host memory (``to_host``).

``on_device`` runs at the start of every thread that touches a CUDA cache or drives a NIXL
agent holding a VRAM registration. ``to_host`` serves a consumer that needs a tensor in
host memory, such as a file.

A new Python thread has no CUDA device of its own. Its first CUDA call makes a context on
GPU 0, whatever the rank's GPU is: a stray context, and memory, on another rank's GPU.
UCX, finding no valid CUDA context in the thread that posts a transfer, turns CUDA IPC
off for it. vLLM's NixlConnector sets the device in its threads for that reason.
"""

from __future__ import annotations

from typing import Protocol

import torch


def on_device(device: torch.device | None) -> None:
    """Make ``device`` this thread's CUDA device when it is a GPU; nothing for a host device.

    So a CPU cache never initializes CUDA."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())


class DeviceEvent(Protocol):
    """A CUDA event, or a stand-in where the work ran on the host."""

    def query(self) -> bool:
        """True once the work recorded before it is done."""
        ...

    def synchronize(self) -> None:
        """Until the work recorded before it is done."""
        ...


class HostDone:
    """The stand-in for a CUDA event where the work ran on the host: always done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory, contiguous: ``tensor`` itself when it is there, else one copy.

    The copy goes into pinned memory, queued on its device's current stream after the work
    before it. An event of that copy alone waits for it, so the device's other streams go on."""

    if tensor.device.type == "cpu":
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record(torch.cuda.current_stream(tensor.device))
    done.synchronize()  # type: ignore[no-untyped-call]
    return out
