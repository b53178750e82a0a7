"""Writing a sample to a safetensors file straight from its view of the reader's pool.

The format (a little-endian u64 header length, a JSON header naming each tensor's dtype,
shape and byte range, then the bytes) is written here rather than with
``safetensors.torch.save_file``, which wants contiguous tensors: a sample in the CPU
block layout is a strided view, and copying it whole first would cost a pass and a
sample-sized buffer. A contiguous tensor is written as it lies; a strided one is
gathered a bounded chunk of rows at a time through one reused buffer. The file is
written under a temporary name, fsynced and renamed, so a file under its final name is
always whole. A tensor on a GPU (a reader whose pool is there) is copied to the host once
(``common.device.to_host``).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from kv_connector.common.device import to_host
from kv_connector.common.errors import ConfigurationError

_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}
# a strided tensor is gathered this much at a time
CHUNK_BYTES = 4 << 20


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _write_tensor(stream: BinaryIO, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        return
    # a sample from a pool on a GPU: one copy to the host
    tensor = to_host(tensor)
    if tensor.is_contiguous():
        stream.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        return
    row_bytes = _nbytes(tensor[0]) if tensor.dim() else _nbytes(tensor)
    rows = max(1, CHUNK_BYTES // max(row_bytes, 1))
    buf = torch.empty((min(rows, tensor.shape[0]), *tensor.shape[1:]), dtype=tensor.dtype)
    for i in range(0, tensor.shape[0], rows):
        part = tensor[i : i + rows]
        out = buf[: part.shape[0]]
        out.copy_(part)
        stream.write(out.reshape(-1).view(torch.uint8).numpy().data)


def write_safetensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    fsync: Callable[[int], None] = os.fsync,
) -> None:
    """Write ``tensors`` (any strides) and ``metadata`` to ``path`` in the safetensors
    format; ``fsync`` makes it durable (a timed one, for the CLI's metrics)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise ConfigurationError(f"cannot write a {t.dtype} tensor to safetensors")
        n = _nbytes(t)
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            _write_tensor(f, t)
        f.flush()
        fsync(f.fileno())


def write_atomically(
    final: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    tmp_dir: Path | None = None,
    fsync: Callable[[int], None] = os.fsync,
) -> Path:
    """Write under a temporary name in ``tmp_dir`` (on the same file system; by default
    ``final``'s directory), fsync, rename, fsync the directory (both with ``fsync``);
    returns ``final``."""
    out_dir = final.parent
    fd, tmp = tempfile.mkstemp(prefix=".hs.", suffix=".tmp", dir=tmp_dir or out_dir)
    os.close(fd)
    try:
        write_safetensors(Path(tmp), tensors, metadata, fsync)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(out_dir, os.O_RDONLY)
    try:
        fsync(dfd)
    finally:
        os.close(dfd)
    return final
