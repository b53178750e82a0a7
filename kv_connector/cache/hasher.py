"""Where the producer computes a share's checksum: a thread of its own (``Hasher``), so
that the WRITE path never waits on the GIL for it, and on a GPU a stream of that
thread's own (``own_stream``). What is computed is ``blocks``'s."""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator

import torch

from kv_connector.common.device import on_device


class Hasher:
    """One thread computing checksums in submission order. Not a ThreadPoolExecutor:
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
        # the cache's GPU, before any checksum reads it
        on_device(self._device)
        while (item := self._q.get()) is not None:
            fn, fut = item
            settle(fut, fn)
            # hold no reference to the sender between jobs: it must be collectable (and
            # its NIXL agent destroyed) before the interpreter finalizes
            del item, fn, fut

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


def settle(fut: concurrent.futures.Future[int], fn: Callable[[], int]) -> None:
    """``fut`` set to ``fn()``'s value, or to the exception it raised."""
    try:
        fut.set_result(fn())
    except Exception as e:
        fut.set_exception(e)


def computed(fn: Callable[[], int]) -> concurrent.futures.Future[int]:
    """``fn()`` computed on the calling thread, given as ``Hasher.submit`` gives it: a
    future, here already done."""
    fut: concurrent.futures.Future[int] = concurrent.futures.Future()
    settle(fut, fn)
    return fut


_streams = threading.local()


@contextlib.contextmanager
def own_stream(device: torch.device) -> Iterator[None]:
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
