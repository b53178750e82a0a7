"""Host memory for buffers that transfers land in: anonymous pages advised to be
transparent huge pages (2 MiB) where the kernel offers them (``madvise`` mode, the
default of most distributions), faulted in once when made.

UCX's shared-memory path (``cma``) pins and copies a buffer page by page, and RDMA NICs
translate it page by page: huge pages cut those costs (a 64 MiB WRITE between two
processes here: 7.5 GB/s into 4 KiB pages, 10-11 GB/s into huge pages). A kernel
without them gives ordinary pages; nothing else changes. Pure: mmap and numpy."""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

HUGE_PAGE_BYTES = 2 << 20  # smaller buffers stay ordinary heap memory


def host_memory(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed uint8 host memory, in huge pages where the kernel offers them.
    The array keeps its mapping alive (``np.frombuffer`` holds it)."""
    if nbytes < HUGE_PAGE_BYTES:
        return np.zeros(nbytes, dtype=np.uint8)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            mem.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(mem, dtype=np.uint8)
    buf.fill(0)  # fault it in once, here, not during the first transfers
    return buf


def shared_host_memory(nbytes: int, name: str = "kv-connector-pool") -> tuple[np.ndarray, int]:
    """``nbytes`` of zeroed uint8 host memory that other processes can map: an anonymous
    memory file (``memfd_create``), mapped shared here and faulted in once. Returns the
    array and the file's descriptor (pass it over a Unix socket; ``mmap`` it there). No
    name in the file system: the memory is gone once the last process holding the
    descriptor or a mapping exits, however it exits."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # shared memory gets huge pages only where shmem_enabled says
            mem.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(mem, dtype=np.uint8)
    buf.fill(0)
    return buf, fd


def map_shared(fd: int, nbytes: int) -> np.ndarray:
    """The memory of ``shared_host_memory``'s descriptor ``fd``, mapped into this process
    (the array keeps the mapping; ``fd`` may be closed after)."""
    mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(mem, dtype=np.uint8)
