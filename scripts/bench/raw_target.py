"""The raw arm's target (``raw_connector``), in the bench's process: a registered pool the
producer WRITEs each prompt's blocks into, its NIXL metadata in a file for the producer,
and the notifications counted. No vLLM here."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kv_connector.wire.nixl_transport import NixlTransport


@dataclass(frozen=True)
class Landed:
    """One prompt's blocks in the pool: from byte ``at``, each shaped ``block_shape`` of
    ``dtype`` as vLLM indexes the cache-only layer's block ([layers, block_size, hidden])."""

    request_id: str
    at: int
    tokens: int
    block_shape: list[int]
    dtype: str

    def states(self, pool: torch.Tensor) -> torch.Tensor:
        """``[tokens, layers, hidden]`` from ``pool``'s bytes (the blocks as the CPU cache
        lays them out: dense, in that index order)."""
        layers, block_size, hidden = self.block_shape
        nb = -(-self.tokens // block_size)
        dtype = getattr(torch, self.dtype)
        nbytes = nb * layers * block_size * hidden * dtype.itemsize
        blocks = pool[self.at : self.at + nbytes].view(dtype).view(nb, layers, block_size, hidden)
        return blocks.permute(0, 2, 1, 3).reshape(nb * block_size, layers, hidden)[: self.tokens]


class RawTarget:
    """The reader's side of the raw arm, in the bench's process: a registered pool of
    ``pool_bytes``, its metadata in ``path`` for the producer, notifications counted."""

    def __init__(self, path: Path, pool_bytes: int) -> None:
        from kv_connector.common.memory import host_memory

        self.path = path
        self._t = NixlTransport(f"raw-target-{os.getpid()}-{path.stem}")
        self.pool = torch.from_numpy(host_memory(pool_bytes))  # the reader pool's kind of memory
        region = self._t.register(self.pool)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"metadata": self._t.metadata.hex(), "addr": region.addr, "nbytes": region.nbytes})
        )
        tmp.rename(path)
        self._peered = False
        self._early: list[float] = []  # arrivals past the last call's count
        self.landed: list[Landed] = []  # every notification, in order

    def arrivals(self, n: int, timeout: float) -> list[float]:
        """When each of the next ``n`` notifications arrived (the producer's metadata loaded
        once it wrote it)."""
        got, self._early = self._early, []
        deadline = time.monotonic() + timeout
        producer = self.path.with_suffix(".producer")
        while len(got) < n:
            if not self._peered and producer.exists():
                self._t.add_peer(bytes.fromhex(producer.read_text()))
                self._peered = True
            now = time.time()
            for _peer, msg in self._t.notifications():
                self.landed.append(Landed(**json.loads(msg)))
                got.append(now)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the raw target got {len(got)} of {n} notifications")
            time.sleep(0.0002)
        got, self._early = got[:n], got[n:]
        return got

    def close(self) -> None:
        self._t.close()


def start_taking(target: RawTarget, n: int, into: list[float]) -> threading.Thread:
    """A thread that puts the next ``n`` arrival times in ``into``."""

    def take() -> None:
        into.extend(target.arrivals(n, 600))

    th = threading.Thread(target=take, daemon=True)
    th.start()
    return th
