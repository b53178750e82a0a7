"""A receive pool's memory: where transfers land, what the checks read, what samples view.

Two kinds behind one face (``PoolMemory``), chosen by the reader's or pull client's
``pool_device``:

- ``HostPool`` (``pool_device=None``, the default): host memory in transparent huge pages
  (``common.memory``); shares are checked in place with xxhash and numpy on the host; a
  sample is a numpy-backed view whose collection ends its lease.
- ``DevicePool`` (``pool_device="cuda:N"``): memory on the trainer's GPU, registered
  with NIXL as VRAM, so a producer's WRITE (push) or the trainer's READ (pull) lands
  where training runs: no host staging, no copy in the trainer. The checks run with
  torch where the pool is, on a stream of the pool's own (they never queue behind the
  training step): fingerprints, each with the values screen of its share's whole rows in
  the same pass, queued behind an event that the push reader's serving thread looks at
  (``queue_fingerprint``) or waited for, and block digests on the GPU; XXH3 (the diagnostic mode,
  and what rows of no whole number of words get) after one copy of the sample to the
  host. A lease ends in stream order: when a sample is released or its last view is
  collected, an event is recorded on the releasing thread's current stream, and the
  pages return to producers only once the work queued before it is done
  (``LeaseFences``), so a kernel still reading a sample never sees the next one land.
  Work on other streams must be synchronized by the user before letting a sample go (as
  with torch's own memory). Before any check or hand-out reads what landed, RDMA writes
  into the GPU are made visible to its kernels (``common.gpudirect``: a flush on a node
  with an RDMA device, nothing where every write is a CUDA copy; a pull pool, whose own
  agent READs, skips it while UCX's report names no RDMA transport for those READs:
  ``narrow_visibility``).
  On a host device (``pool_device="cpu"``) the same code runs on memory torch allocates:
  what CI tests; ``None`` is the host pool tuned for CPUs.

Nothing here imports nixl or touches sockets.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from kv_connector.common.device import DeviceEvent, HostDone
from kv_connector.common.errors import ConfigurationError
from kv_connector.common.gpudirect import Visibility
from kv_connector.common.memory import host_memory, shared_host_memory
from kv_connector.reader.pool.lease import CopyBuffers, Key, Lease, leased_view, sample_view
from kv_connector.reader.pool.values import RowsScreen, find_bad_values, samples, screen_flags, screen_rows
from kv_connector.wire import fingerprint
from kv_connector.wire.block_digest import checksum_of_digests, sample_block_digests, states_block_digests
from kv_connector.wire.integrity import sample_checksum
from kv_connector.wire.protocol import Manifest, ShareChecksum
from kv_connector.wire.transport import Region, Transport, TransportError
from kv_connector.wire.ucx_report import Mem, Op


class PoolDeviceError(ConfigurationError):
    """The pool cannot live on the device asked for (no CUDA, no such GPU, no room)."""


class LeaseFences:
    """Lease ends waiting for the device work queued before them (stream order). On a
    host device every end is done at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # a collector may end a lease inside ``settle``
        self._lock = threading.RLock()
        self._waiting: list[tuple[DeviceEvent, Callable[[], None]]] = []

    def _event(self) -> DeviceEvent:
        if self.device.type != "cuda":
            # work on the host is done when the call returns
            return HostDone()
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def add(self, done: Callable[[], None], event: DeviceEvent | None = None) -> None:
        """Call ``done`` once the work queued so far on this thread's stream is done (or
        ``event``, when given, says so)."""
        event = event if event is not None else self._event()
        if event.query():
            done()
            return
        with self._lock:
            self._waiting.append((event, done))

    def settle(self) -> int:
        """Call the ends whose work is done (in any order: streams finish independently);
        returns how many still wait."""
        with self._lock:
            # ends added meanwhile go to the new list
            waiting, self._waiting = self._waiting, []
        ready: list[tuple[DeviceEvent, Callable[[], None]]] = []
        left: list[tuple[DeviceEvent, Callable[[], None]]] = []
        for e, d in waiting:
            (ready if e.query() else left).append((e, d))
        with self._lock:
            self._waiting[:0] = left
        for _e, done in ready:
            done()
        return self.waiting

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)


class PoolMemory(Protocol):
    """What the reader and the pull client need of their pool's memory."""

    device: torch.device
    # uint8 [nbytes], registered with the transport once
    tensor: torch.Tensor
    lease_fences: LeaseFences

    def checksum(self, base: int, manifest: Manifest, blocks: list[int], kind: ShareChecksum) -> int:
        """A share's checksum (``blocks``: indices in the sample) recomputed from the run of
        the sample at byte ``base``, as ``kind`` says."""
        ...

    def screened(self, base: int, manifest: Manifest, blocks: list[int]) -> tuple[int, RowsScreen | None]:
        """A share's fingerprint (``checksum`` of kind ``FINGERPRINT``) and the values screen
        of the share's rows: in host memory, where the screen samples (wide rows), from the
        lines its words were read in (``fingerprint_screened``), else None; in a device pool,
        of its whole rows in the same pass."""
        ...

    def bad_values(self, base: int, manifest: Manifest, full: bool = False) -> str | None:
        """``reader.pool.values.find_bad_values`` of the sample at ``base``: sampled in host
        memory unless ``full``, in full on a GPU (one pass where it lies)."""
        ...

    def leased(self, base: int, manifest: Manifest, lease: Lease) -> torch.Tensor:
        """The sample's [T, L, H] view; ``lease`` ends when no tensor sharing it is left
        (made with ``ordered``, it ends in stream order)."""
        ...

    def copy_out(self, base: int, manifest: Manifest, lease: Lease, copies: CopyBuffers) -> torch.Tensor:
        """The sample copied out of the pool (on the pool's device, contiguous; on the host
        into one of ``copies``' reused buffers); ``lease`` ends once the copy no longer
        needs the pages."""
        ...

    def ordered(self, release: Callable[[Key], None]) -> Callable[[Key], None]:
        """``release`` (a lease's end: its pages go back) made to wait for the device work
        queued on the ending thread's stream before it (``LeaseFences``); as it is on the host."""
        ...


def pool_checksum(
    pool: memoryview, base: int, manifest: Manifest, blocks: list[int], kind: ShareChecksum
) -> int:
    """The checksum of a share (``blocks``, indices in the sample) recomputed from host
    memory whose run of the sample starts at byte ``base``, as ``kind`` says: XXH3-64 of
    its bytes (``integrity``), of its block digests recomputed on the host
    (``block_digest``), or of the words its fingerprint samples (``fingerprint``)."""
    if kind in (ShareChecksum.BLOCKS, ShareChecksum.FINGERPRINT):
        n = manifest.geometry.sample_bytes(manifest.num_blocks)
        states = sample_view(torch.frombuffer(pool, dtype=torch.uint8, offset=base, count=n), manifest)
        if kind is ShareChecksum.FINGERPRINT:
            return fingerprint.states_record(states, manifest, blocks)
        return checksum_of_digests(manifest, blocks, sample_block_digests(states, manifest, blocks))
    return sample_checksum(pool, base, manifest, blocks)


def fingerprint_screened(
    states: torch.Tensor, manifest: Manifest, blocks: list[int]
) -> tuple[int, RowsScreen | None]:
    """A share's fingerprint from a sample's ``[T, L, H]`` view and the sampled values
    screen of the share's rows on the same read: the line around each fingerprinted word
    (a line is what the memory reads for a word anyway) instead of a screen that reads
    lines of its own at hand-out. None for rows the screen reads whole."""
    if not samples(states.shape[-1]):
        return fingerprint.states_record(states, manifest, blocks), None
    record, lines = fingerprint.states_record_lines(states, manifest, blocks)
    return record, None if lines is None else screen_rows(lines)


def check_share(
    memory: PoolMemory, base: int, manifest: Manifest, blocks: list[int], kind: ShareChecksum, screen: bool
) -> tuple[int, RowsScreen | None]:
    """A share's checksum of ``kind`` recomputed from ``memory``; with ``screen`` (the values
    screen samples) and fingerprints, the screen of its rows read with it (``screened``)."""
    if screen and kind is ShareChecksum.FINGERPRINT:
        return memory.screened(base, manifest, blocks)
    return memory.checksum(base, manifest, blocks, kind), None


def run_of(tensor: torch.Tensor, base: int, manifest: Manifest) -> torch.Tensor:
    """The uint8 bytes of a sample's run in a pool tensor."""
    return tensor[base : base + manifest.geometry.sample_bytes(manifest.num_blocks)]


class HostPool:
    """Host memory in huge pages, checked in place on the host. ``shared``: in a memory
    file other processes can map (``fd``; a rank's fetch agent, ``reader.agent.fetch_agent``)."""

    def __init__(self, nbytes: int, shared: bool = False) -> None:
        self.device = torch.device("cpu")
        self.fd: int | None = None
        if shared:
            self._np, self.fd = shared_host_memory(nbytes)
        else:
            # huge pages where the kernel offers them
            self._np = host_memory(nbytes)
        self.tensor = torch.from_numpy(self._np)
        self.lease_fences = LeaseFences(self.device)

    def checksum(self, base: int, manifest: Manifest, blocks: list[int], kind: ShareChecksum) -> int:
        return pool_checksum(self._np.data, base, manifest, blocks, kind)

    def screened(self, base: int, manifest: Manifest, blocks: list[int]) -> tuple[int, RowsScreen | None]:
        return fingerprint_screened(
            sample_view(run_of(self.tensor, base, manifest), manifest), manifest, blocks
        )

    def bad_values(self, base: int, manifest: Manifest, full: bool = False) -> str | None:
        return find_bad_values(
            sample_view(run_of(self.tensor, base, manifest), manifest), manifest.layer_ids, sample=not full
        )

    def leased(self, base: int, manifest: Manifest, lease: Lease) -> torch.Tensor:
        return leased_view(self._np, base, manifest, lease)

    def ordered(self, release: Callable[[Key], None]) -> Callable[[Key], None]:
        # the host's work is done when the call that ends a lease returns
        return release

    def copy_out(self, base: int, manifest: Manifest, lease: Lease, copies: CopyBuffers) -> torch.Tensor:
        view = sample_view(run_of(self.tensor, base, manifest), manifest)
        hidden = copies.take(view.numel() * view.element_size()).view(view.dtype).view(view.shape)
        hidden.copy_(view)
        del view
        # copied: its pages go back now
        lease.release()
        return hidden


class _DeviceRange:
    """A range of device memory as CUDA's array interface describes it: a tensor made from
    it keeps this object alive, so its collection says no view of the range is left."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            # no stream: the pages' bytes are already where NIXL put them
            "version": 2,
        }


def device_of(pool_device: str | torch.device) -> torch.device:
    """The device a pool may live on, or ``PoolDeviceError`` naming what is missing."""
    try:
        device = torch.device(pool_device)
    except (RuntimeError, TypeError) as e:
        raise PoolDeviceError(f"pool_device {pool_device!r} is not a device: {e}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise PoolDeviceError(f"pool_device {pool_device!r}: a pool lives in host memory or on a CUDA GPU")
    if not torch.cuda.is_available():
        raise PoolDeviceError(
            f"pool_device {pool_device!r} needs CUDA, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); leave pool_device unset "
            "for a host pool"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        raise PoolDeviceError(
            f"pool_device {pool_device!r}: this process sees {torch.cuda.device_count()} GPU(s)"
        )
    return torch.device("cuda", index)


@dataclass
class QueuedCheck:
    """A share's fingerprint (and values screen) queued on a device pool's stream, its
    results copied to host memory behind ``event``: ``result`` reads them once
    ``event.query()`` says the work is done, and never waits for the device."""

    event: DeviceEvent
    manifest: Manifest
    blocks: list[int]
    # the sampled words [n, layers], on the host
    words: torch.Tensor
    # ``screen_flags``, on the host; None without the screen
    flags: torch.Tensor | None

    def result(self) -> tuple[int, RowsScreen | None]:
        record = fingerprint.record(self.manifest, self.blocks, self.words)
        return record, None if self.flags is None else RowsScreen.of(self.flags)


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied to pinned host memory on the current stream, not waited for (itself on the host)."""
    if tensor.device.type == "cpu":
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    return out


class DevicePool:
    """Pool memory on ``device`` (a GPU, or the host for CI), checked with torch there."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        try:
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            free, total = torch.cuda.mem_get_info(device)
            raise PoolDeviceError(
                f"no room for a {nbytes / (1 << 20):.0f} MiB pool on {device}: {free / (1 << 20):.0f} MiB "
                f"free of {total / (1 << 20):.0f} MiB; lower pool_bytes, or make the pool before "
                "training takes the memory"
            ) from None
        self.lease_fences = LeaseFences(device)
        # before each read of what landed
        self.visible = Visibility(device)
        self._np = self.tensor.numpy() if device.type == "cpu" else None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def _side(self) -> Iterator[None]:
        """The pool's own stream for its checks: they never wait behind training's kernels."""
        if self._stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            yield

    def checksum(self, base: int, manifest: Manifest, blocks: list[int], kind: ShareChecksum) -> int:
        self.visible()
        run = run_of(self.tensor, base, manifest)
        with self._side():
            # a gather of its sampled words, on the device
            if kind is ShareChecksum.FINGERPRINT:
                return fingerprint.states_record(sample_view(run, manifest), manifest, blocks)
            if kind is ShareChecksum.BLOCKS:
                return checksum_of_digests(
                    manifest, blocks, states_block_digests(sample_view(run, manifest), manifest, blocks)
                )
            # XXH3 reads host bytes: one copy of the sample
            host = run.cpu()
        return sample_checksum(host.numpy().data, 0, manifest, blocks)

    def screened(self, base: int, manifest: Manifest, blocks: list[int]) -> tuple[int, RowsScreen | None]:
        """The fingerprint and the screen of the share's whole rows: both queued on the pool's
        stream, then one wait for them (the hand-out then reads nothing more)."""
        queued = self.queue_fingerprint(base, manifest, blocks, True)
        queued.event.synchronize()
        return queued.result()

    def queue_fingerprint(
        self, base: int, manifest: Manifest, blocks: list[int], screen: bool
    ) -> QueuedCheck:
        """``checksum`` of kind FINGERPRINT (with ``screen``, ``screened``) queued on the pool's
        stream and not waited for: the caller looks at the event and reads the result when
        it is done, so no thread blocks on the device and none is handed the check."""
        self.visible()
        with self._side():
            states = sample_view(run_of(self.tensor, base, manifest), manifest)
            words = _pinned_copy(fingerprint.states_words(states, manifest, blocks))
            flags = (
                _pinned_copy(screen_flags(states, fingerprint.share_spans(manifest, blocks)))
                if screen
                else None
            )
            event: DeviceEvent = HostDone()
            if self._stream is not None:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
        return QueuedCheck(event, manifest, blocks, words, flags)

    def bad_values(self, base: int, manifest: Manifest, full: bool = False) -> str | None:
        self.visible()
        with self._side():
            return find_bad_values(
                sample_view(run_of(self.tensor, base, manifest), manifest), manifest.layer_ids
            )

    def leased(self, base: int, manifest: Manifest, lease: Lease) -> torch.Tensor:
        self.visible()
        n = manifest.geometry.sample_bytes(manifest.num_blocks)
        span: object
        if self._np is not None:
            # a new array object
            span = self._np[base : base + n]
            # its storage keeps ``span`` alive, as every view's does
            raw = torch.from_numpy(span)
        else:
            span = _DeviceRange(self.tensor.data_ptr() + base, n)
            # shares the pool's memory, keeps ``span``
            raw = torch.as_tensor(span, device=self.device)
        weakref.finalize(span, lease.release)
        return sample_view(raw, manifest)

    def copy_out(self, base: int, manifest: Manifest, lease: Lease, copies: CopyBuffers) -> torch.Tensor:
        self.visible()
        view = sample_view(run_of(self.tensor, base, manifest), manifest)
        hidden = torch.empty(view.shape, dtype=view.dtype, device=self.device)
        # queued on this thread's stream: the pages go back after it
        hidden.copy_(view)
        del view
        lease.release()
        return hidden

    def ordered(self, release: Callable[[Key], None]) -> Callable[[Key], None]:
        return lambda key: self.lease_fences.add(functools.partial(release, key))


def register_pool(transport: Transport, pool: PoolMemory) -> Region:
    """Register ``pool``'s memory with ``transport`` once; for a pool on a GPU, a refusal
    says that NIXL must be a CUDA build matching torch's."""
    try:
        return transport.register(pool.tensor)
    except TransportError as e:
        if pool.device.type != "cuda":
            raise
        raise TransportError(
            f"NIXL cannot register the pool's {pool.tensor.numel() / (1 << 20):.0f} MiB on "
            f"{pool.device} ({e}): "
            f"a GPU pool needs NIXL built for CUDA, the wheel for torch's CUDA {torch.version.cuda} "
            "(nixl-cu13 for CUDA 13, nixl-cu12 for CUDA 12), with UCX's CUDA transports"
        ) from e


def narrow_visibility(pool: PoolMemory, transport: Transport) -> None:
    """For a pool whose own agent READs every byte into it (pull): make its GPUDirect
    visibility flush only while UCX chose an RDMA transport for those READs (the agent's
    report says; ``gpudirect.needs_flush``). Nothing for a host pool, or a transport that
    reads no report."""
    rdma_into = getattr(transport, "rdma_into", None)
    if isinstance(pool, DevicePool) and rdma_into is not None:
        pool.visible.rdma_writes = functools.partial(rdma_into, Op.READ, Mem.GPU)


def make_pool(nbytes: int, pool_device: str | torch.device | None, shared: bool = False) -> PoolMemory:
    """The pool for ``pool_device`` (None: the host pool; ``shared``: one other processes
    can map)."""
    if pool_device is None:
        return HostPool(nbytes, shared)
    if shared:
        raise PoolDeviceError("a pool shared with other processes lives in host memory (pool_device=None)")
    return DevicePool(nbytes, device_of(pool_device))


__all__ = [
    "DevicePool",
    "HostPool",
    "LeaseFences",
    "PoolDeviceError",
    "PoolMemory",
    "QueuedCheck",
    "check_share",
    "device_of",
    "fingerprint_screened",
    "make_pool",
    "narrow_visibility",
    "pool_checksum",
    "register_pool",
]
