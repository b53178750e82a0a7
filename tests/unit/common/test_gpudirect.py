"""Whether a pool flushes RDMA writes before it reads what landed: only a pool on a GPU,
only where an RDMA device UCX may use can write it, only where the GPU does not order
such writes itself (a flush where it offers one, a device synchronize where it offers
none); and a pool in host memory or on a host device never imports cuda-bindings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kv_connector.common.gpudirect import (
    DeviceRdma,
    Flush,
    needs_flush,
    node_rdma_devices,
    plan,
    usable_rdma_devices,
)

REPO = Path(__file__).resolve().parents[3]

# as CUDA reports them: a GPU behind a NIC that needs the flush; one whose writes are ordered
NEEDS_FLUSH = DeviceRdma(supported=True, flush_options=1, writes_ordering=0)
ORDERED = DeviceRdma(supported=True, flush_options=1, writes_ordering=100)
NO_FLUSH_API = DeviceRdma(supported=True, flush_options=2, writes_ordering=0)
NO_GPUDIRECT = DeviceRdma(supported=False, flush_options=0, writes_ordering=0)


@pytest.mark.parametrize(
    ("on_gpu", "devices", "attrs", "want"),
    [
        (False, ["mlx5_0"], NEEDS_FLUSH, Flush.NONE),  # host memory: no GPU caches to flush
        (True, [], NEEDS_FLUSH, Flush.NONE),  # no NIC: cuda_ipc or cuda_copy wrote it
        (True, ["mlx5_0"], NEEDS_FLUSH, Flush.FLUSH),
        (True, ["mlx5_0"], ORDERED, Flush.NONE),  # the flush would be a no-op
        (True, ["mlx5_0"], NO_GPUDIRECT, Flush.NONE),  # no NIC can write this GPU
        (True, ["mlx5_0"], NO_FLUSH_API, Flush.SYNCHRONIZE),
        (True, ["mlx5_0"], None, Flush.SYNCHRONIZE),  # the attributes cannot be read
    ],
)
def test_which_pools_flush(on_gpu: bool, devices: list[str], attrs: DeviceRdma | None, want: Flush) -> None:
    assert plan(on_gpu, devices, attrs) is want


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, ["efa_0", "mlx5_0", "mlx5_1"]),
        ({"UCX_TLS": "tcp"}, []),
        ({"UCX_TLS": "self,sm,cuda_ipc,cuda_copy"}, []),
        ({"UCX_TLS": "rc_x,cuda_copy"}, ["efa_0", "mlx5_0", "mlx5_1"]),
        ({"UCX_TLS": "^tcp"}, ["efa_0", "mlx5_0", "mlx5_1"]),
        ({"UCX_TLS": "all"}, ["efa_0", "mlx5_0", "mlx5_1"]),
        ({"UCX_NET_DEVICES": "mlx5_1:1,eth0"}, ["mlx5_1"]),
        ({"UCX_NET_DEVICES": "lo"}, []),
        ({"UCX_NET_DEVICES": "all"}, ["efa_0", "mlx5_0", "mlx5_1"]),
    ],
)
def test_the_devices_ucx_may_use(env: dict[str, str], want: list[str]) -> None:
    assert usable_rdma_devices(["efa_0", "mlx5_0", "mlx5_1"], env) == want


def test_the_nodes_devices_are_read_from_sysfs(tmp_path: Path) -> None:
    assert node_rdma_devices(tmp_path / "absent") == []
    for name in ("mlx5_1", "mlx5_0"):
        (tmp_path / name).mkdir()
    assert node_rdma_devices(tmp_path) == ["mlx5_0", "mlx5_1"]


# a pool on the host device and a host pool, checked and handed out as the reader does,
# in a Python where importing cuda-bindings (the ``cuda`` package) fails, and an attempt
# from our package is recorded (torch's own, guarded, at its import are not ours)
NO_CUDA_BINDINGS = """
import sys, traceback
tried = []
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "cuda":
            ours = [f.filename for f in traceback.extract_stack() if "/kv_connector/" in f.filename]
            tried.extend(ours)
            raise ImportError(name + " refused")
        return None
sys.meta_path.insert(0, _Refuse())

import torch
from kv_connector.common.gpudirect import Flush
from kv_connector.reader.pool.lease import CopyBuffers, Lease
from kv_connector.reader.pool.memory import make_pool
from kv_connector.wire.protocol import ShareChecksum
from tests.unit.reader.pool.helpers import manifest

m = manifest("TLH", "bfloat16", 40)
for device in ("cpu", None):  # the device pool on the host device, the host pool
    pool = make_pool(1 << 20, device)
    pool.tensor[:] = 1
    pool.checksum(0, m, [0, 1, 2], ShareChecksum.FINGERPRINT)
    pool.bad_values(0, m)
    view = pool.leased(0, m, Lease(("p", "r"), lambda k: None))
    pool.copy_out(0, m, Lease(("p", "r2"), lambda k: None), CopyBuffers(1 << 20))
    assert device is None or pool.visible.plan is Flush.NONE
assert not tried, tried
assert not any(k == "cuda" or k.startswith("cuda.") for k in sys.modules), sorted(sys.modules)
print("clean")
"""


def test_host_pools_never_import_cuda_bindings() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", NO_CUDA_BINDINGS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "clean", proc.stderr[-3000:]


@pytest.mark.parametrize(
    ("planned", "rdma_writes", "want"),
    [
        (Flush.NONE, True, False),  # nothing planned: nothing to narrow
        (Flush.FLUSH, None, True),  # writers unknown (a push pool, or nothing read yet)
        (Flush.FLUSH, True, True),
        (Flush.FLUSH, False, False),  # every write a CUDA copy (cuda_ipc): no flush
        (Flush.SYNCHRONIZE, False, False),
        (Flush.SYNCHRONIZE, None, True),
    ],
)
def test_a_pool_that_knows_its_writers_flushes_only_after_rdma(
    planned: Flush, rdma_writes: bool | None, want: bool
) -> None:
    assert needs_flush(planned, rdma_writes) is want


def test_a_pull_pool_on_a_device_asks_its_agent_about_its_reads() -> None:
    import torch

    from kv_connector.reader.pool.memory import DevicePool, HostPool, narrow_visibility
    from kv_connector.wire.ucx_report import Mem, Op

    asked: list[tuple[Op, Mem]] = []

    class Agent:
        def rdma_into(self, op: Op, local: Mem) -> bool | None:
            asked.append((op, local))
            return False

    pool = DevicePool(1 << 12, torch.device("cpu"))
    narrow_visibility(pool, Agent())  # type: ignore[arg-type]
    assert pool.visible.rdma_writes is not None and pool.visible.rdma_writes() is False
    assert asked == [(Op.READ, Mem.GPU)]
    narrow_visibility(HostPool(1 << 12), Agent())  # type: ignore[arg-type]  # a host pool: nothing to do
    bare = DevicePool(1 << 12, torch.device("cpu"))
    narrow_visibility(bare, object())  # type: ignore[arg-type]  # no report: flushes as planned
    assert bare.visible.rdma_writes is None
