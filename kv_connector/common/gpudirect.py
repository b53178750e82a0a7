"""GPUDirect RDMA visibility: whether a pool on a GPU must flush RDMA writes before it
reads what landed, and the flush.

An RDMA NIC writing into GPU memory reports completion before the GPU's kernels are sure
to see the bytes. ``cudaDeviceFlushGPUDirectRDMAWrites`` (to the owner) makes them
visible. Writes that are CUDA copies need nothing: ``cuda_ipc`` between processes of one
node, ``cuda_copy`` behind tcp or shared memory. Host memory needs nothing either. Only a
NIC writes GPU memory by RDMA, so a node without an RDMA device UCX may use never
flushes. The GPU's own attributes say when a flush is a no-op. A pull pool's own agent
posts every READ into it, so it learns UCX's transports and skips the flush while none is
RDMA (``needs_flush``). A push pool cannot learn its producers' and flushes as planned.
``plan`` and ``needs_flush`` are pure; cuda-bindings is imported only to read those
attributes and to flush, on a GPU.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# InfiniBand, RoCE and EFA devices alike
RDMA_DEVICES = Path("/sys/class/infiniband")

# cudaFlushGPUDirectRDMAWritesOptions and cudaGPUDirectRDMAWritesOrdering, as CUDA numbers them
# cudaDeviceFlushGPUDirectRDMAWrites is supported
OPTION_HOST = 1
# writes are visible to the owning device without a flush
ORDERING_OWNER = 100


class Flush(enum.Enum):
    """What a pool does before it reads samples that landed."""

    # host memory, no RDMA device, or the GPU orders such writes itself
    NONE = "none"
    # cudaDeviceFlushGPUDirectRDMAWrites(current device, to owner)
    FLUSH = "flush"
    # the GPU offers no flush: a device synchronize stands in
    SYNCHRONIZE = "synchronize"


@dataclass(frozen=True)
class DeviceRdma:
    """What a GPU says of GPUDirect RDMA (``cudaDevAttrGPUDirectRDMA*``)."""

    supported: bool
    flush_options: int
    writes_ordering: int


# UCX transport names (UCX_TLS) that can ride an RDMA device; "^..." excludes, "all" is all
_RDMA_TLS = ("rc", "dc", "ud", "ib", "srd", "gga", "all")


def usable_rdma_devices(devices: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The RDMA devices of this node UCX may use for an agent.

    They are ``devices``, less those ``UCX_NET_DEVICES`` leaves out (``mlx5_0:1,eth0``).
    There are none when ``UCX_TLS`` names only transports that do not ride one (``tcp``,
    ``cuda_ipc,cuda_copy,sm``)."""
    tls = environ.get("UCX_TLS", "").strip()
    if tls and not tls.startswith("^"):
        names = [t.strip() for t in tls.split(",") if t.strip()]
        if not any(n == r or n.startswith(r + "_") for n in names for r in _RDMA_TLS):
            return []
    net = environ.get("UCX_NET_DEVICES", "").strip()
    if net and net != "all":
        allowed = {d.split(":", 1)[0] for d in net.split(",")}
        return [d for d in devices if d in allowed]
    return list(devices)


def plan(pool_on_gpu: bool, rdma_devices: Sequence[str], device: DeviceRdma | None) -> Flush:
    """What a pool does before it reads what landed.

    Nothing for host memory, nor where no RDMA device may write it. Nothing where the GPU
    takes no GPUDirect RDMA, or orders its writes for their owner already. Else a flush
    when the GPU offers one, and a device synchronize when it does not or cannot be asked
    (``device`` None)."""
    if not pool_on_gpu or not rdma_devices:
        return Flush.NONE
    if device is None:
        return Flush.SYNCHRONIZE
    if not device.supported or device.writes_ordering >= ORDERING_OWNER:
        return Flush.NONE
    return Flush.FLUSH if device.flush_options & OPTION_HOST else Flush.SYNCHRONIZE


def needs_flush(planned: Flush, rdma_writes: bool | None) -> bool:
    """Whether a pool flushes (or synchronizes) now: as ``planned``, unless the transports
    that wrote it are known (``rdma_writes`` not None) and none of them is RDMA (every
    write a CUDA copy: ``cuda_ipc``, ``cuda_copy``)."""
    return planned is not Flush.NONE and rdma_writes is not False


def node_rdma_devices(root: Path = RDMA_DEVICES) -> list[str]:
    """This node's RDMA devices (``mlx5_0``, ``efa_0``), by their sysfs names."""
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:
        return []


def _runtime() -> Any:
    """cuda-bindings' CUDA runtime module (``cuda.bindings.runtime``; ``cuda.cudart`` before
    cuda-python 12.6), or None where it is not installed."""
    try:
        from cuda.bindings import runtime

        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart  # type: ignore[attr-defined]

        return cudart
    except ImportError:
        return None


def _ok(rt: Any, result: Any) -> Any:
    """The value of a cuda-bindings call (``(err, value...)``), or RuntimeError naming ``err``."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA runtime error {err}")
    return rest[0] if rest else None


def device_rdma(index: int) -> DeviceRdma | None:
    """GPU ``index``'s GPUDirect RDMA attributes, or None where cuda-bindings is missing or
    cannot read them."""
    rt = _runtime()
    if rt is None:
        return None
    attr = rt.cudaDeviceAttr
    try:
        return DeviceRdma(
            supported=bool(_ok(rt, rt.cudaDeviceGetAttribute(attr.cudaDevAttrGPUDirectRDMASupported, index))),
            flush_options=int(
                _ok(rt, rt.cudaDeviceGetAttribute(attr.cudaDevAttrGPUDirectRDMAFlushWritesOptions, index))
            ),
            writes_ordering=int(
                _ok(rt, rt.cudaDeviceGetAttribute(attr.cudaDevAttrGPUDirectRDMAWritesOrdering, index))
            ),
        )
    # an old cuda-bindings without these names, a driver refusing
    except Exception as e:
        log.warning("cannot read GPU %d's GPUDirect RDMA attributes: %s", index, e)
        return None


def flush_to_owner() -> None:
    """``cudaDeviceFlushGPUDirectRDMAWrites`` on this thread's current device, to its owner."""
    rt = _runtime()
    _ok(
        rt,
        rt.cudaDeviceFlushGPUDirectRDMAWrites(
            rt.cudaFlushGPUDirectRDMAWritesTarget.cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
            rt.cudaFlushGPUDirectRDMAWritesScope.cudaFlushGPUDirectRDMAWritesToOwner,
        ),
    )


class Visibility:
    """Called before a pool's memory is read: makes RDMA writes that completed before the call visible.

    They become visible to ``device``'s kernels, as ``plan`` decided: nothing, a flush, or a
    device synchronize. Host devices decide nothing and import nothing. ``devices``: the
    node's RDMA devices, read from sysfs unless given."""

    def __init__(
        self,
        device: torch.device,
        environ: Mapping[str, str] | None = None,
        devices: Sequence[str] | None = None,
    ) -> None:
        self.device = device
        self.plan = Flush.NONE
        # flushes or synchronizes done
        self.calls = 0
        # calls where the transports known wrote no byte by RDMA
        self.skipped = 0
        # set by a pool whose agent posts every transfer into it (a pull pool): whether any
        # transport UCX chose for them is RDMA, None while it knows none
        self.rdma_writes: Callable[[], bool | None] | None = None
        self._lock = threading.Lock()
        self._do: Callable[[], None] = lambda: None
        if device.type != "cuda":
            return
        found = node_rdma_devices() if devices is None else devices
        devices = usable_rdma_devices(found, os.environ if environ is None else environ)
        if not devices:
            # no NIC may write this GPU: every write into it is a CUDA copy
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        attrs = device_rdma(index)
        self.plan = plan(True, devices, attrs)
        if self.plan is Flush.FLUSH:
            self._do = flush_to_owner
        elif self.plan is Flush.SYNCHRONIZE:
            self._do = lambda: torch.cuda.synchronize(device)
        log.log(
            logging.WARNING if self.plan is Flush.SYNCHRONIZE else logging.INFO,
            "pool on %s with RDMA devices %s: %s before each check and hand-out (%s)",
            device,
            ", ".join(devices),
            self.plan.value,
            attrs if attrs is not None else "no GPU attributes: `pip install cuda-bindings` to flush instead",
        )

    def __call__(self) -> None:
        if self.plan is Flush.NONE:
            return
        if not needs_flush(self.plan, None if self.rdma_writes is None else self.rdma_writes()):
            with self._lock:
                self.skipped += 1
            return
        with torch.cuda.device(self.device):
            self._do()
        with self._lock:
            self.calls += 1
