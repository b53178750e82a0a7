"""Host memory for buffers that transfers land in, advised to be transparent huge pages.

UCX's shared-memory path pins and copies a buffer page by page, and RDMA NICs translate it
page by page, so 2 MiB pages cut both costs. The kernel gives them in its ``madvise`` mode,
the default of most distributions; without them a buffer gets ordinary pages and nothing
else changes. Buffers are faulted in once when made. Pure: mmap and numpy.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

# smaller buffers stay ordinary heap memory
HUGE_PAGE_BYTES = 2 << 20


def host_memory(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed uint8 host memory, in huge pages where the kernel offers them.
    The array keeps its mapping alive (``np.frombuffer`` holds it)."""
    if nbytes < HUGE_PAGE_BYTES:
        return np.zeros(nbytes, dtype=np.uint8)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # a kernel without transparent huge pages
        with contextlib.suppress(OSError):
            mem.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(mem, dtype=np.uint8)
    # fault it in once, here, not during the first transfers
    buf.fill(0)
    return buf


def shared_host_memory(nbytes: int, name: str = "kv-connector-pool") -> tuple[np.ndarray, int]:
    """``nbytes`` of zeroed uint8 host memory that other processes can map, with its descriptor.

    It is an anonymous memory file (``memfd_create``), mapped shared and faulted in once; pass the
    descriptor over a Unix socket and ``mmap`` it there. It has no name in the file system, so the
    memory is gone once the last process holding it exits, however it exits.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # shared memory gets huge pages only where shmem_enabled says
        with contextlib.suppress(OSError):
            mem.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(mem, dtype=np.uint8)
    buf.fill(0)
    return buf, fd


def map_shared(fd: int, nbytes: int) -> np.ndarray:
    """The memory of ``shared_host_memory``'s descriptor ``fd``, mapped into this process
    (the array keeps the mapping; ``fd`` may be closed after)."""
    mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(mem, dtype=np.uint8)
