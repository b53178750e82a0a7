"""r: a raw NIXL WRITE of the same blocks from the same kind of registered cache into
another process's registered memory (``raw_target_proc``; no protocol, no hand-out); rc: the
same with XXH3 at both ends, the ceiling of ex over r on this machine; ra: r whose cache
reuses a sample's blocks only once the target said the sample landed (an ack on a pipe),
the ceiling of e over r for any design that keeps a sample until its reader has it."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from scripts.bench.datapath.shape import BLOCK, HIDDEN, LAYERS
from scripts.bench.paired import cpu_seconds


def raw_target_proc(conn: Any, pool_bytes: int, checks: bool = False, acks: Any = None) -> None:
    """Registers a pool, then on ("expect", n, sample_bytes) polls until n WRITEs notified
    and answers (end time, CPU seconds spent). With ``checks``, each landed sample (the
    slot its notification names) is hashed (XXH3) on a thread of its own, as the reader's
    checker does, and the answer waits for the last hash. With ``acks`` (a pipe's end),
    each notification is answered on it at once: the sample landed."""
    import queue
    import threading

    import xxhash

    from kv_connector.common.memory import host_memory
    from kv_connector.wire.nixl_transport import NixlTransport

    t = NixlTransport(f"raw-target-{os.getpid()}")
    buf = host_memory(pool_bytes)  # the same kind of memory as the reader's pool
    region = t.register(torch.from_numpy(buf))
    conn.send((t.metadata, region.addr, region.nbytes))
    t.add_peer(conn.recv())
    landed: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    hashed = threading.Semaphore(0)

    def check() -> None:
        while (item := landed.get()) is not None:
            at, n = item
            xxhash.xxh3_64_intdigest(buf[at : at + n].data)
            hashed.release()

    if checks:
        threading.Thread(target=check, daemon=True).start()
    while (cmd := conn.recv())[0] == "expect":
        c0 = cpu_seconds()
        got = 0
        while got < cmd[1]:
            for _peer, msg in t.notifications():
                got += 1
                if acks is not None:
                    acks.send_bytes(msg)
                if checks:
                    landed.put((int(msg) * cmd[2], cmd[2]))
        for _ in range(cmd[1] if checks else 0):
            hashed.acquire()
        conn.send((time.time(), cpu_seconds() - c0))
    landed.put(None)
    t.close()


class RawArm:
    """r: raw NIXL WRITEs of each request's scattered blocks into pages of another
    process's registered pool, ``in_flight`` requests at a time. With ``checks`` (rc), both
    ends also hash every sample with XXH3 on a thread of their own, the initiator from its
    cache as each WRITE is posted and the target from its pool as each lands: the least
    any design with a full checksum at both ends pays on this machine (no protocol, no
    credits), the ceiling of ex over r. With ``acked`` (ra), a sample's blocks are written
    again only once the target acknowledged it (the cache holds ``in_flight`` samples, as
    e's does): the least any design pays that keeps a sample's blocks until its reader has
    it (so that a reader's restart loses nothing) with a cache of that size, no checks, no
    credits, the ceiling of e over r."""

    def __init__(
        self,
        n_req: int,
        tokens: int,
        num_blocks: int,
        in_flight: int,
        checks: bool = False,
        acked: bool = False,
        hidden: int = HIDDEN,
    ) -> None:
        from kv_connector.wire.nixl_transport import NixlTransport
        from kv_connector.wire.transport import Region

        self.n_req, self.tokens, self.num_blocks, self.in_flight = n_req, tokens, num_blocks, in_flight
        self.block_bytes = BLOCK * len(LAYERS) * hidden * 2
        self.nb = -(-tokens // BLOCK)
        pool_bytes = in_flight * self.nb * self.block_bytes
        self.cache = torch.randn(num_blocks, len(LAYERS), BLOCK, hidden, dtype=torch.bfloat16)
        self._hasher = ThreadPoolExecutor(1) if checks else None
        ctx = mp.get_context("spawn")
        self.conn, b = ctx.Pipe()
        self._acks: Any = None  # the end the target's acks arrive on (ra)
        acks: Any = None
        if acked:
            self._acks, acks = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=raw_target_proc, args=(b, pool_bytes, checks, acks))
        self.proc.start()
        md, addr, size = self.conn.recv()
        self.t = NixlTransport(f"raw-init-{os.getpid()}")
        self.local = self.t.register(self.cache)
        self.conn.send(self.t.metadata)
        self.peer = self.t.add_peer(md)
        self.remote = Region(addr, size, "DRAM", 0)
        self.next = 0
        self.acks_seen = 0  # the target's acks taken (ra), the warm-up's included
        self._writes(1)  # warm-up: connection set-up

    def _blocks(self, i: int) -> list[int]:
        return [(i * self.nb + k) % (self.num_blocks - 1) + 1 for k in range(self.nb)]

    def _spans(self, i: int) -> Any:
        import numpy as np

        nb, bb = self.nb, self.block_bytes
        slot = i % self.in_flight
        return np.array([(bl * bb, (slot * nb + k) * bb, bb) for k, bl in enumerate(self._blocks(i))])

    def _hash(self, i: int) -> int:
        from kv_connector.wire.integrity import block_checksum

        raw = self.cache.view(-1).view(torch.uint8).numpy().data
        bb = self.block_bytes
        offsets = ((k, bl * bb) for k, bl in enumerate(self._blocks(i)))
        return block_checksum(raw, offsets, lambda _j: [(0, bb)])  # whole blocks, as the arm WRITEs them

    def _writes(self, n: int) -> tuple[float, float, float, float]:
        sample_bytes = self.nb * self.block_bytes
        self.conn.send(("expect", n, sample_bytes))
        c0 = cpu_seconds()
        t0 = time.time()
        live: list[Any] = []
        hashes = []
        unacked = 0  # samples WRITten whose blocks the target has not yet acknowledged
        post_s = 0.0  # inside the posts: the copy, on this machine's shared-memory path
        end = self.next + n
        while self.next < end or live or unacked:
            while self.next < end and max(len(live), unacked) < self.in_flight:
                if self._hasher is not None:
                    hashes.append(self._hasher.submit(self._hash, self.next))
                slot, spans = str(self.next % self.in_flight).encode(), self._spans(self.next)
                t_post = time.perf_counter()
                live.append(self.t.write(self.peer, self.local, self.remote, spans, slot))
                post_s += time.perf_counter() - t_post
                self.next += 1
                unacked += self._acks is not None
            still = [x for x in live if not self.t.poll(x)]
            if self._acks is not None and (unacked or not still):
                # the blocks come free at the ack; wait for one only when nothing is polled
                while unacked and self._acks.poll(0 if still else 0.001):
                    self._acks.recv_bytes()
                    unacked -= 1
                    self.acks_seen += 1
            elif still and len(still) == len(live):
                time.sleep(0)  # nothing completed: let the hashing thread have the GIL, do not spin
            live = still
        for h in hashes:
            h.result()
        t_end, target_cpu = self.conn.recv()
        return t_end - t0, cpu_seconds() - c0, target_cpu, post_s

    def round(self) -> dict[str, float]:
        acks_before = self.acks_seen
        seconds, init_cpu, target_cpu, post_s = self._writes(self.n_req)
        return {
            "acks": float(self.acks_seen - acks_before),
            "seconds": seconds, "units": float(self.n_req * self.tokens),
            "nbytes": float(self.n_req * self.nb * self.block_bytes), "cpu_s": init_cpu + target_cpu,
            "producer_cpu_s": init_cpu, "reader_cpu_s": target_cpu, "post_s": post_s,
        }  # fmt: skip

    def close(self) -> dict[str, float]:
        self.conn.send(("stop",))
        self.proc.join(30)
        self.t.close()
        if self._hasher is not None:
            self._hasher.shutdown()
        return {}
