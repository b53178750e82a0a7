"""An engine's doorbell across its processes: the worker side rings it, the scheduler's nap ends.

The worker side rings it when a step would have news for the scheduler: a sample
acknowledged, refused or released. The scheduler side's nap (``idle_steps``) ends when it
rings.

vLLM's workers run in processes of their own at TP>1, and in its OpenAI server at any TP,
so an event in one process is not enough. The scheduler side binds a Unix datagram socket
in Linux's abstract namespace, named after the engine and this user. A ring is one
datagram to it, never blocking; a ring nobody hears is dropped. Rings in the scheduler
side's own process set an event as well. A second engine of the same name on this host
cannot bind the name, so its naps end only by their length (``listening`` says so).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable

_bells: dict[str, Doorbell] = {}
_bells_lock = threading.Lock()


def bell_address(engine: str) -> bytes:
    """The abstract socket name of ``engine``'s bell (per user: another user's engine of
    the same name does not share it)."""
    digest = hashlib.sha256(engine.encode()).hexdigest()[:32]
    return f"\0kv-connector-bell-{os.getuid()}-{digest}".encode()


class Doorbell:
    """One engine's bell in this process (``doorbell(engine)``): ``ring`` from anywhere,
    ``listen`` once in the scheduler side's process, then ``wait`` there."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.address = bell_address(engine)
        # rings in this process
        self._event = threading.Event()
        # the listener (scheduler side)
        self._sock: socket.socket | None = None
        # this process's ringing end, made on first ring
        self._out: socket.socket | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ ringing
    def ring(self) -> None:
        """News for the scheduler side, wherever it runs (never blocks, never raises)."""
        self._event.set()
        with self._lock:
            if self._out is None:
                self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._out.setblocking(False)
            out = self._out
        # nobody listens (yet), or rings are queued already
        with contextlib.suppress(OSError):
            out.sendto(b"!", self.address)

    # a ``threading.Event``'s name for it
    set = ring

    # ------------------------------------------------------------------ hearing
    def listen(self) -> bool:
        """Hear rings from other processes from now on.

        False where the name is taken (another engine of this name on this host) or
        abstract sockets are missing."""
        with self._lock:
            if self._sock is not None:
                return True
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.bind(self.address)
            except OSError:
                sock.close()
                return False
            sock.setblocking(False)
            self._sock = sock
            return True

    @property
    def listening(self) -> bool:
        return self._sock is not None

    def is_set(self) -> bool:
        """Rung since the last ``clear`` (in this process, or heard from another one)."""
        if self._event.is_set():
            return True
        if self._drain():
            self._event.set()
            return True
        return False

    def clear(self) -> None:
        self._drain()
        self._event.clear()

    def wait(
        self, timeout: float, wake: Callable[[], bool] | None = None, slice_s: float = 0.01
    ) -> bool:
        """Wait until it rings (True), ``wake()`` says so (False) or ``timeout`` passes (False).

        ``wake`` and rings from other processes are looked at every ``slice_s``."""
        deadline = time.monotonic() + timeout
        while True:
            if self.is_set():
                return True
            left = deadline - time.monotonic()
            if left <= 0 or (wake is not None and wake()):
                return False
            step = min(left, slice_s)
            sock = self._sock
            if sock is None:
                if self._event.wait(step if wake is not None else left):
                    return True
                continue
            with contextlib.suppress(OSError, ValueError):
                select.select([sock], [], [], step)

    def close(self) -> None:
        with self._lock:
            for s in (self._sock, self._out):
                if s is not None:
                    s.close()
            self._sock = self._out = None

    def _drain(self) -> bool:
        sock, heard = self._sock, False
        while sock is not None:
            try:
                sock.recv(64)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            heard = True
        return heard


def doorbell(engine: str) -> Doorbell:
    """The bell of the engine named ``engine`` in this process (one per name, made on
    first use)."""
    with _bells_lock:
        bell = _bells.get(engine)
        if bell is None:
            bell = _bells[engine] = Doorbell(engine)
        return bell


__all__ = ["Doorbell", "bell_address", "doorbell"]
