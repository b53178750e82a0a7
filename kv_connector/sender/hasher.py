"""Computing a share's digest on the producer: the bytes of a rank's share of a sample,
read from the cache where they are, hashed on a thread of their own (``Hasher``) so
that the WRITE path never waits on the GIL for it; or, for a cache on a GPU, its block
digests (``block_digest``) computed there on a stream of the hashing thread's own."""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator

import torch

from kv_connector.common.device import on_device
from kv_connector.sender.jobs import Job
from kv_connector.wire.block_digest import cache_block_digests, share_digest
from kv_connector.wire.integrity import block_checksum, manifest_bytes, spans_of_sample


class Hasher:
    """One thread computing digests in submission order. Not a ThreadPoolExecutor:
    those refuse work once the interpreter starts exiting, which is exactly when a
    worker's shutdown drains its last samples."""

    def __init__(self, name: str, device: torch.device | None = None) -> None:
        self._device = device
        self._q: queue.SimpleQueue[tuple[Callable[[], int], concurrent.futures.Future[int]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], int]) -> concurrent.futures.Future[int]:
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        on_device(self._device)  # the cache's GPU, before any digest reads it
        while (item := self._q.get()) is not None:
            fn, fut = item
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)
            # hold no reference to the sender between jobs: it must be collectable (and
            # its NIXL agent destroyed) before the interpreter finalizes
            del item, fn, fut

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


def cache_blocks(raw: torch.Tensor, block_bytes: int, pitch: int) -> torch.Tensor:
    """The cache's bytes ``raw`` (a flat uint8 view, block i at ``i * pitch``) as
    ``[num_blocks, block_bytes]``, the padding between blocks left out."""
    return raw.as_strided(((raw.numel() - block_bytes) // pitch + 1, block_bytes), (pitch, 1))


def share_checksum(raw: torch.Tensor, job: Job, stage: bool | None = None, pitch: int | None = None) -> int:
    """XXH3-64 of ``job``'s manifest and share of its sample's bytes (``integrity``), read from the
    cache's bytes ``raw`` (a flat uint8 view, blocks ``pitch`` bytes apart, one block by
    default). A host cache is hashed in place; a device cache's share is staged to host
    memory once (``stage`` forces either path)."""
    m = job.manifest
    pitch = pitch or m.block_bytes
    spans_of, head = spans_of_sample(m), manifest_bytes(m)
    if not (raw.device.type != "cpu" if stage is None else stage):
        offsets = ((j, job.block_ids[j] * pitch) for j in job.share)
        return block_checksum(raw.numpy().data, offsets, spans_of, head)
    idx = torch.tensor([job.block_ids[j] for j in job.share], device=raw.device)
    host = cache_blocks(raw, m.block_bytes, pitch).index_select(0, idx).cpu().view(-1)
    staged = ((j, i * m.block_bytes) for i, j in enumerate(job.share))
    return block_checksum(host.numpy().data, staged, spans_of, head)


_streams = threading.local()


@contextlib.contextmanager
def _own_stream(device: torch.device) -> Iterator[None]:
    """On a GPU, this thread's own stream (its kernels do not queue behind the engine's
    next forward on the default stream); on CPU, nothing. A job is hashed only once the
    producer's step that wrote its blocks is done on the device (its ``ReadyGate``), so
    the states are there to be read."""
    if device.type != "cuda":
        yield
        return
    stream = getattr(_streams, "stream", None)
    if stream is None:
        stream = _streams.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        yield


def share_block_digest(raw: torch.Tensor, job: Job, pitch: int | None = None) -> int:
    """The checksum of ``job``'s share over its block digests (``block_digest``), computed
    where the cache's bytes ``raw`` (a flat uint8 view, blocks ``pitch`` bytes apart, one
    block by default) are; 8 bytes per block reach the host."""
    m = job.manifest
    g = m.geometry
    blocks = cache_blocks(raw, m.block_bytes, pitch or m.block_bytes)
    cache = blocks.view(getattr(torch, g.dtype)).view(-1, *g.block_shape())
    with _own_stream(raw.device):
        digests = cache_block_digests(cache, m, job.block_ids, job.share)
    return share_digest(m, job.share, digests)
