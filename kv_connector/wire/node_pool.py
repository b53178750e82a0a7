"""A receive pool in host memory that producers on the same node map and write with a
copy of their own, instead of a WRITE through UCX.

Between a GPU and another process's host memory UCX has no zero-copy path: without
``RMA_PPLN_ENABLE`` it moves the bytes over ``tcp``, with it through a pipeline of
staging buffers. A reader whose host pool lives in a memory file (``memfd``) publishes
it here (``publish``: the file's descriptor, inode, the pool's address and size, in a
small record of a per-user directory named by the reader's NIXL agent); a producer's
transport on the same node finds the record by the peer's agent name (``attach``), maps
the same pages, makes them pinned for its GPU, and copies each WRITE's spans into them
(``copy_spans``: one CUDA copy engine transfer per span, no staging). The notification
still goes through NIXL once the copy is done, so the reader's side is unchanged. A
record of another boot, a process gone or a file replaced maps nothing: the producer
keeps NIXL's WRITE. Nothing here imports nixl.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kv_connector.common.device import DeviceEvent, HostDone
from kv_connector.common.errors import ConfigurationError

log = logging.getLogger(__name__)

# "0": producers never map a reader's pool
SWITCH = "KV_CONNECTOR_NODE_POOL"
_OFF = ("0", "n", "no", "false", "off")
# how a mapped WRITE is reported, beside UCX's transports
TRANSPORT = "node_pool"


def switched_off(environ: Mapping[str, str]) -> bool:
    return environ.get(SWITCH, "").strip().lower() in _OFF


@dataclass(frozen=True)
class Offer:
    """A published pool: where a producer of this node finds its pages."""

    agent: str
    pid: int
    fd: int
    inode: int
    # the pool's address in the reader (what its registration names)
    addr: int
    nbytes: int
    boot_id: str
    # the reader process's start time (``/proc/PID/stat`` field 22)
    start: str


def offer_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user directory of offers: ``$XDG_RUNTIME_DIR/kv-connector-node-pools``,
    else one in the temporary directory named by the user id."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "kv-connector-node-pools"
    return Path(tempfile.gettempdir()) / f"kv-connector-node-pools-{os.getuid()}"


def _file_name(agent: str) -> str:
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in agent)
    return f"{safe[:200]}.json"


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """A process's start time in clock ticks since boot ("" when it is gone): with the
    pid, names one process for the life of a boot."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # field 22; the name in parentheses may hold spaces
    return stat.rsplit(")", 1)[1].split()[19]


def make_offer(agent: str, fd: int, addr: int, nbytes: int) -> Offer:
    pid = os.getpid()
    return Offer(agent, pid, fd, os.fstat(fd).st_ino, addr, nbytes, boot_id(), process_start(pid))


def publish(offer: Offer, directory: Path | None = None) -> Path:
    """Write ``offer`` where producers of this node look for it (readable by this user
    only; replaced whole, never seen half written); returns its path."""
    root = directory if directory is not None else offer_dir()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = root / _file_name(offer.agent)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".offer-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(offer), f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def withdraw(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def read_offer(agent: str, directory: Path | None = None) -> Offer | None:
    root = directory if directory is not None else offer_dir()
    try:
        data = json.loads((root / _file_name(agent)).read_text())
        offer = Offer(**data)
    except (OSError, ValueError, TypeError):
        return None
    return offer if offer.agent == agent else None


def refusal(offer: Offer, here_boot: str) -> str | None:
    """Why an offer cannot be mapped from this process (None: it may be): another boot
    (another node, or a reboot), or its process gone or replaced."""
    if not offer.boot_id or offer.boot_id != here_boot:
        return "published on another node or boot"
    if process_start(offer.pid) != offer.start:
        return f"process {offer.pid} is gone"
    return None


class MappedPool:
    """A reader's pool mapped into this process: ``tensor`` is its bytes (uint8), at
    ``addr`` in the reader's address space."""

    def __init__(self, offer: Offer, array: np.ndarray, mem: mmap.mmap) -> None:
        self.offer = offer
        self.addr = offer.addr
        self.nbytes = offer.nbytes
        self.tensor = torch.from_numpy(array)
        self._mem = mem
        self._pinned: torch.device | None = None

    def covers(self, addr: int, nbytes: int) -> bool:
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes

    def pin(self, device: torch.device) -> bool:
        """Make the mapping pinned for CUDA (``cudaHostRegister``), so copies from ``device``
        run on a copy engine straight into these pages; False where CUDA refuses."""
        if device.type != "cuda" or self._pinned is not None:
            return self._pinned is not None or device.type != "cuda"
        rt = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        with torch.cuda.device(device):
            err = rt.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
        if err != rt.cudaError.success:
            log.warning("cannot pin a reader's mapped pool for %s: CUDA error %s", device, err)
            return False
        self._pinned = device
        return True

    def close(self) -> None:
        if self._pinned is not None:
            rt = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            with torch.cuda.device(self._pinned):
                rt.cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = None
        del self.tensor
        # a view still alive keeps the mapping
        with contextlib.suppress(BufferError):
            self._mem.close()


def attach(agent: str, directory: Path | None = None) -> tuple[MappedPool | None, str]:
    """The pool ``agent`` published, mapped here, or None and why not."""
    offer = read_offer(agent, directory)
    if offer is None:
        return None, "no pool published"
    why = refusal(offer, boot_id())
    if why is not None:
        return None, why
    try:
        fd = os.open(f"/proc/{offer.pid}/fd/{offer.fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return None, f"cannot open its memory file: {e}"
    try:
        if os.fstat(fd).st_ino != offer.inode:
            return None, "its memory file was replaced"
        mem = mmap.mmap(fd, offer.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as e:
        return None, f"cannot map its memory file: {e}"
    finally:
        os.close(fd)
    return MappedPool(offer, np.frombuffer(mem, dtype=np.uint8), mem), ""


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a flat uint8 tensor (any permutation of a contiguous one)."""
    nbytes = tensor.numel() * tensor.element_size()
    out = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    lowest = tensor.storage_offset() * tensor.element_size()
    return out.set_(tensor.untyped_storage(), lowest, (nbytes,), (1,))


def copy_spans(
    src: torch.Tensor, dst: torch.Tensor, spans: np.ndarray, stream: torch.cuda.Stream | None = None
) -> DeviceEvent:
    """Copy (src offset, dst offset, length) rows of bytes from ``src`` into ``dst`` (flat
    uint8 tensors); returns what says the copies are done: at once on the host, an event
    on ``stream`` (the copies queued there) for a GPU source."""
    rows = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
    if len(rows) and (
        (rows < 0).any()
        or int((rows[:, 0] + rows[:, 2]).max()) > src.numel()
        or int((rows[:, 1] + rows[:, 2]).max()) > dst.numel()
    ):
        raise ConfigurationError("a span runs outside its memory")
    if src.device.type != "cuda":
        for s, d, n in rows.tolist():
            dst[d : d + n].copy_(src[s : s + n])
        return HostDone()
    with torch.cuda.device(src.device), torch.cuda.stream(stream or torch.cuda.current_stream(src.device)):
        for s, d, n in rows.tolist():
            dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
    return event
