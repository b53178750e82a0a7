"""Check c of the device tier: NIXL between two processes, from a cache on ``device``.

Through the package's own pieces that need no vLLM:

- push: ``HiddenStatesSender`` WRITEs samples from a registered "cache" tensor on the
  device into another process's ``HiddenStatesReader`` host pool;
- pull: another process's ``PullServer`` holds samples in a registered cache on the
  device, and this process's ``PullClient`` READs them into its host pool.

With ``pool_device`` the receiving pools (ours and the raw transfers') are on that device
(the trainer's GPU: VRAM to VRAM), and each sample's tensor must be there.

Each is checked byte for byte (both processes build the same cache from one seed; the
receiving one compares every sample with its own copy), then timed on samples of whole
blocks against raw NIXL transfers of the same blocks between the same two processes
(a raw WRITE into, or READ from, registered memory, no protocol, no checks): ``d`` is
ours over raw. Then eight samples one at a time: the time from a sample's finish (push: the
sender is handed it; pull: its handle is out) to its tensor being usable by the training
loop (handed out, the work queued on its device before done). The checksum is what the
connector's default resolves to for the cache (``ChecksumOption("auto")``).

Every agent runs with the package's UCX defaults (``kv_connector.wire.ucx_report``) and
reads back the transport UCX picked for each pairing; ``pairings`` lists, for each of
ours, GB/s against the raw transfer, the transports of ours and of raw, and the time from
finish to usable. With a pool on a GPU, ``gpudirect`` says what the pool does to make RDMA
writes visible there, from the GPU's own attributes, and times the flush itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from kv_connector.producer.options import ChecksumOption
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.transport import MemType
from kv_connector.wire.ucx_report import Mem, Op, Pairing, Reach

PRODUCER = "gpu-check"
RAW = "gpu-check-raw-"  # the raw transfers' agents' names begin so
SEED = 11
IN_FLIGHT = 4  # raw transfers in flight, as fetch_iter's default


@dataclass(frozen=True)
class Size:
    """What one check moves: a cache of ``cache_blocks`` blocks, ``samples`` timed
    samples of ``tokens`` tokens each (whole blocks) on random blocks of it."""

    hidden: int
    layers: int
    block: int
    cache_blocks: int
    tokens: int
    samples: int

    @property
    def layout(self) -> BlockLayout:
        return BlockLayout("TLH", self.block, self.layers, self.hidden, "bfloat16")

    @property
    def sample_bytes(self) -> int:
        return self.layout.blocks_for(self.tokens) * self.layout.block_bytes


GPU_SIZE = Size(hidden=4096, layers=4, block=16, cache_blocks=1024, tokens=1024, samples=48)  # 32 MiB samples
CPU_SIZE = Size(hidden=256, layers=4, block=16, cache_blocks=64, tokens=128, samples=8)
CHECKED_TOKENS = (1, 15, 16, 17, 300)  # the byte-for-byte round: partial last blocks too


def make_cache(size: Size) -> torch.Tensor:
    """The cache both processes build: finite bf16 states, [blocks, block, layers, hidden]."""
    gen = torch.Generator().manual_seed(SEED)
    shape = (size.cache_blocks, size.block, size.layers, size.hidden)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)


def plan(size: Size, tokens: Iterable[int], tag: str) -> list[tuple[str, int, list[int]]]:
    """(request id, tokens, blocks) per sample, on random blocks of the cache."""
    rng = random.Random(f"{tag}-{size}")
    out = []
    for i, n in enumerate(tokens):
        nb = size.layout.blocks_for(n)
        out.append((f"{tag}{i}", n, rng.sample(range(size.cache_blocks), nb)))
    return out


def token_ids(n: int) -> list[int]:
    return [(7 * k + 3) % 1000 for k in range(n)]


def expected(cache: torch.Tensor, size: Size, n: int, blocks: list[int]) -> torch.Tensor:
    return cache[torch.tensor(blocks)].reshape(-1, size.layers, size.hidden)[:n]


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    got = got.cpu()
    return got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16))


def raw_spans(size: Size, samples: list[tuple[str, int, list[int]]], i: int) -> np.ndarray:
    """(cache offset, pool offset, length) rows of sample ``i``'s whole blocks, into pool
    slot ``i % IN_FLIGHT`` (the raw transfers' own placement)."""
    bb, base = size.layout.block_bytes, (i % IN_FLIGHT) * size.sample_bytes
    return np.array([(b * bb, base + k * bb, bb) for k, b in enumerate(samples[i][2])], dtype=np.int64)


def _raw_pool(nbytes: int, pool_device: str | None) -> torch.Tensor:
    """The raw transfers' landing memory: of the kind our pool is (host or device)."""
    if pool_device is not None:
        return torch.zeros(nbytes, dtype=torch.uint8, device=pool_device)
    from kv_connector.common.memory import host_memory

    return torch.from_numpy(host_memory(nbytes))


def _usable(t: torch.Tensor) -> None:
    """Work queued on the sample's device before it is done: the training loop may use it."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def _median_ms(seconds: list[float]) -> float:
    return sorted(seconds)[len(seconds) // 2] * 1e3


def _landed_where_asked(landed_on: str, pool_device: str | None) -> None:
    want = torch.device(pool_device or "cpu")
    if torch.device(landed_on) != want:
        raise AssertionError(f"a sample's tensor is on {landed_on}, its pool was asked on {want}")


def _spawn(target: Callable[..., None], *args: Any) -> tuple[Connection, Any]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(there, *args), daemon=True)
    proc.start()
    return here, proc


def _stop(conn: Connection, proc: Any) -> None:
    with contextlib.suppress(OSError):  # it may have died already
        conn.send(("stop",))
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=10)


def _answer(conn: Connection, timeout: float = 600) -> Any:
    """The child's next answer; a child's failure comes back as ("error", why)."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer within {timeout:.0f} s")
    got = conn.recv()
    if isinstance(got, tuple) and got and got[0] == "error":
        raise RuntimeError(f"the other process failed: {got[1]}")
    return got


# ---------------------------------------------------------------------------- push
def _reader_proc(
    conn: Connection, size: Size, pool_device: str | None, check_values: bool, node_pool: bool = False
) -> None:
    """The consumer of push: a HiddenStatesReader, and a raw NIXL target pool, both in
    host memory or on ``pool_device``; ``node_pool``: the reader's pool offered to
    producers on this node (``wire.node_pool``)."""
    try:
        from kv_connector.reader import HiddenStatesReader
        from kv_connector.wire.nixl_transport import NixlTransport

        cache = make_cache(size)
        raw = NixlTransport(f"{RAW}target-{os.getpid()}")
        pool = _raw_pool(IN_FLIGHT * size.sample_bytes, pool_device)
        region = raw.register(pool)
        pool_bytes = max(256 << 20, 2 * IN_FLIGHT * size.sample_bytes)
        with HiddenStatesReader(
            pool_bytes=pool_bytes,
            pool_device=pool_device,
            check_values=check_values,
            require_checksum="auto" if check_values else "never",
            node_pool=node_pool,
        ) as reader:
            conn.send(
                (reader.address, raw.metadata, region.addr, region.nbytes, region.mem_type, region.device_id)
            )
            while (cmd := conn.recv())[0] != "stop":
                if cmd[0] == "check":  # every sample against this process's own copy
                    wrong = []
                    for _ in cmd[1]:
                        s = reader.get(timeout=300)
                        _rid, n, blocks = next(x for x in cmd[1] if x[0] == s.request_id)
                        if not same(s.hidden_states, expected(cache, size, n, blocks)):
                            wrong.append(s.request_id)
                        s.release()
                    conn.send({"compared": len(cmd[1]), "wrong": wrong})
                elif cmd[0] == "take":  # as a trainer that lets each sample go at the next
                    for s in reader.samples(cmd[1], timeout=300):
                        s.release()
                    conn.send(time.time())
                elif cmd[0] == "one":  # when the next sample is usable by the training loop
                    with reader.get(timeout=300) as s:
                        _usable(s.hidden_states)
                        conn.send((time.time(), str(s.hidden_states.device)))
                elif cmd[0] == "raw":
                    raw.add_peer(cmd[1])
                    conn.send("ok")
                elif cmd[0] == "stats":
                    conn.send({k: getattr(reader.stats(), k) for k in ("verify_s", "values_check_s")})
                elif cmd[0] == "expect":  # raw WRITEs: their notifications
                    got = 0
                    while got < cmd[1]:
                        got += len(raw.notifications())
                    conn.send(time.time())
        raw.close()
    except Exception as e:  # the parent reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _ship_all(sender: Any, samples: list[tuple[str, int, list[int]]], timeout: float = 300) -> None:
    from kv_connector.producer.fingerprints import Fingerprints
    from kv_connector.wire.identity import make_identity

    # the fingerprint words (the default record), taken where the cache is as a step takes them
    taken = Fingerprints(sender.blocks, sender.layout.block_size)
    for rid, n, blocks in samples:
        words = taken.ship(rid, n, blocks)
        sender.ship(rid, token_ids(n), blocks, make_identity(None, None), words=words)
    want, done = {s[0] for s in samples}, set[str]()
    deadline = time.monotonic() + timeout
    while done != want:
        done |= sender.take_finished()
        failed = sender.take_failed()
        if failed:
            rid, f = next(iter(failed.items()))
            raise AssertionError(f"{len(failed)} samples failed, {rid}: {f.why}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(want - done)} samples not acknowledged within {timeout:.0f} s")
        time.sleep(0.0005)


def push(
    device: torch.device,
    size: Size,
    pool_device: str | None = None,
    option: ChecksumOption = ChecksumOption.AUTO,
    check_values: bool = True,
    node_pool: bool = False,
) -> dict[str, Any]:
    """Push, checked and timed; ``option``, ``check_values``: for a diagnosis; ``node_pool``:
    into a host pool the reader offers to this node's producers (copies, not UCX WRITEs;
    the raw WRITEs still go through UCX, so ``d`` is the mapped path against UCX's)."""
    from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
    from kv_connector.wire.nixl_transport import NixlTransport
    from kv_connector.wire.transport import Region

    conn, proc = _spawn(_reader_proc, size, pool_device, check_values, node_pool)
    try:
        address, raw_md, pool_addr, pool_bytes, pool_mem, pool_dev = _answer(conn)
        cache = make_cache(size).to(device)
        layout = size.layout
        checksum = option.resolve(cache.is_cuda, layout)
        cfg = SenderConfig(consumer_address=address, producer_id=PRODUCER, checksum=checksum)
        sender = HiddenStatesSender(cfg, cache, layout, list(range(size.layers)))
        if not sender.connected.wait(60):
            raise TimeoutError(f"the sender did not connect to the reader: {sender.link_error}")
        checked = plan(size, CHECKED_TOKENS, "check")
        conn.send(("check", checked))
        _ship_all(sender, checked)
        verdict = _answer(conn)
        if verdict["wrong"]:
            raise AssertionError(f"samples that landed different from the cache: {verdict['wrong']}")
        timed = plan(size, [size.tokens] * size.samples, "push")
        conn.send(("take", 1))
        _ship_all(sender, plan(size, [size.tokens], "warm"))  # not timed
        _answer(conn)
        conn.send(("stats",))
        r0, s0 = _answer(conn), sender.stats()
        conn.send(("take", len(timed)))
        t0 = time.time()
        _ship_all(sender, timed)
        ours_s = _answer(conn) - t0
        conn.send(("stats",))
        r1, s1 = _answer(conn), sender.stats()
        # where a sample's time went (ms a sample, summed over samples in flight together)
        stages = {f"{k}_ms": (getattr(s1, k) - getattr(s0, k)) / len(timed) * 1e3 for k in _SENDER_STAGES}
        stages |= {f"reader_{k}_ms": (r1[k] - r0[k]) / len(timed) * 1e3 for k in r0}
        latency, landed_on = [], ""
        for one in plan(size, [size.tokens] * 8, "one"):  # finished -> usable, one at a time
            conn.send(("one",))
            t0 = time.time()
            _ship_all(sender, [one])
            t_usable, landed_on = _answer(conn)
            latency.append(t_usable - t0)
        sender.close()
        _landed_where_asked(landed_on, pool_device)

        t = NixlTransport(f"{RAW}init-{os.getpid()}")
        local = t.register(cache)
        peer = t.add_peer(raw_md)
        conn.send(("raw", t.metadata))
        _answer(conn)
        remote = Region(pool_addr, pool_bytes, pool_mem, pool_dev)

        def writes(samples: list[tuple[str, int, list[int]]]) -> float:
            conn.send(("expect", len(samples)))
            t0 = time.time()
            live: list[Any] = []
            for i in range(len(samples)):
                while len(live) >= IN_FLIGHT:
                    live = [x for x in live if not t.poll(x)]
                live.append(t.write(peer, local, remote, raw_spans(size, samples, i), b"w"))
            while live:
                live = [x for x in live if not t.poll(x)]
            return float(_answer(conn)) - t0

        writes(plan(size, [size.tokens], "warm"))
        raw_s = writes(timed)
        t.close()
    finally:
        _stop(conn, proc)
    nbytes = len(timed) * size.sample_bytes
    return {
        "checksum": checksum.name if checksum else None,
        "samples_compared": verdict["compared"],
        "bytes": nbytes,
        "ours_GBps": nbytes / ours_s / 1e9,
        "raw_write_GBps": nbytes / raw_s / 1e9,
        "d": raw_s / ours_s,
        "cache_mem": local.mem_type,
        "pool_mem": pool_mem,
        "sample_device": landed_on,
        "finish_to_usable_ms_median": _median_ms(latency),
        "stages_ms_a_sample": stages,
        "transports": transports(Op.WRITE, local.mem_type, pool_mem, raw=False),
        "raw_transports": transports(Op.WRITE, local.mem_type, pool_mem, raw=True),
    }


_SENDER_STAGES = ("grant_wait_s", "write_s", "ack_wait_s", "checksum_s")


# ---------------------------------------------------------------------------- pull
def _producer_proc(conn: Connection, size: Size, device: str) -> None:
    """The producer of pull: a PullServer over a cache on ``device``, and a raw agent
    with the same cache registered."""
    try:
        from kv_connector.cache.blocks import CacheBlocks
        from kv_connector.producer.fingerprints import Fingerprints
        from kv_connector.producer.pull.server import PullServer, PullServerConfig
        from kv_connector.wire.handle import PullHandle, make_nonce
        from kv_connector.wire.nixl_transport import NixlTransport

        cache = make_cache(size).to(device)
        checksum = ChecksumOption("auto").resolve(cache.is_cuda, size.layout)
        layer_ids = list(range(size.layers))
        config = PullServerConfig(
            size.layout, tuple(layer_ids), PRODUCER, ("127.0.0.1", 0), 600.0, checksum=checksum
        )
        server = PullServer(cache, config)
        taken = Fingerprints(CacheBlocks(cache, size.layout), size.layout.block_size)
        raw = NixlTransport(f"{RAW}source-{os.getpid()}")
        region = raw.register(cache)
        conn.send(
            (checksum.name if checksum else None, raw.metadata, region.addr, region.nbytes, region.device_id)
        )
        while True:
            while not conn.poll(0.001):
                raw.notifications()  # progress for raw READs from this agent's memory
                server.take_freed()
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "hold":
                handles = []
                for rid, n, blocks in cmd[1]:
                    nonce = make_nonce()
                    server.hold(rid, nonce, token_ids(n), blocks, words=taken.ship(rid, n, blocks))
                    handles.append(PullHandle(PRODUCER, rid, nonce, [server.address]).encode())
                server.finished([s[0] for s in cmd[1]])
                conn.send(handles)
            elif cmd[0] == "raw":
                raw.add_peer(cmd[1])
                conn.send("ok")
        server.close()
        raw.close()
    except Exception as e:  # the parent reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))


def pull(device: torch.device, size: Size, pool_device: str | None = None) -> dict[str, Any]:
    from kv_connector.reader import FetchError, PullClient
    from kv_connector.wire.nixl_transport import NixlTransport
    from kv_connector.wire.transport import Region

    conn, proc = _spawn(_producer_proc, size, str(device))
    try:
        checksum, raw_md, cache_addr, cache_bytes, dev = _answer(conn)
        cache = make_cache(size)
        client_pool = max(256 << 20, 2 * IN_FLIGHT * size.sample_bytes)
        client = PullClient(pool_bytes=client_pool, pool_device=pool_device)
        checked = plan(size, CHECKED_TOKENS, "check")
        conn.send(("hold", checked))
        wrong = []
        for (rid, n, blocks), handle in zip(checked, _answer(conn), strict=True):
            with client.fetch(handle) as s:
                if not same(s.hidden_states, expected(cache, size, n, blocks)):
                    wrong.append(rid)
        if wrong:
            raise AssertionError(f"samples read different from the cache: {wrong}")

        def fetch_all(samples: list[tuple[str, int, list[int]]]) -> float:
            conn.send(("hold", samples))
            handles = _answer(conn)
            t0 = time.time()
            for s in client.fetch_iter(handles, in_flight=IN_FLIGHT):
                if isinstance(s, FetchError):
                    raise AssertionError(f"a fetch failed: {s}")
                s.release()
            return time.time() - t0

        timed = plan(size, [size.tokens] * size.samples, "pull")
        fetch_all(plan(size, [size.tokens], "warm"))
        ours_s = fetch_all(timed)
        latency, landed_on = [], ""
        for one in plan(size, [size.tokens] * 8, "one"):  # handle out -> usable, one at a time
            conn.send(("hold", [one]))
            (handle,) = _answer(conn)
            t0 = time.time()
            with client.fetch(handle) as s:
                _usable(s.hidden_states)
                latency.append(time.time() - t0)
                landed_on = str(s.hidden_states.device)
        client.close()
        _landed_where_asked(landed_on, pool_device)

        t = NixlTransport(f"{RAW}reader-{os.getpid()}")
        pool = _raw_pool(IN_FLIGHT * size.sample_bytes, pool_device)
        local = t.register(pool)
        peer = t.add_peer(raw_md)
        conn.send(("raw", t.metadata))
        _answer(conn)
        remote = Region(cache_addr, cache_bytes, "VRAM" if device.type == "cuda" else "DRAM", dev)

        def reads(samples: list[tuple[str, int, list[int]]]) -> float:
            t0 = time.time()
            live: list[Any] = []
            for i in range(len(samples)):
                while len(live) >= IN_FLIGHT:
                    live = [x for x in live if not t.poll(x)]
                # raw_spans gives (cache, pool, n); a READ takes (local, remote, n)
                spans = raw_spans(size, samples, i)[:, [1, 0, 2]]
                live.append(t.read(peer, local, remote, spans))
            while live:
                live = [x for x in live if not t.poll(x)]
            return time.time() - t0

        reads(plan(size, [size.tokens], "warm"))
        raw_s = reads(timed)
        t.close()
    finally:
        _stop(conn, proc)
    nbytes = len(timed) * size.sample_bytes
    return {
        "checksum": checksum,
        "samples_compared": len(checked),
        "bytes": nbytes,
        "ours_GBps": nbytes / ours_s / 1e9,
        "raw_read_GBps": nbytes / raw_s / 1e9,
        "d": raw_s / ours_s,
        "cache_mem": remote.mem_type,
        "pool_mem": local.mem_type,
        "sample_device": landed_on,
        "fetch_to_usable_ms_median": _median_ms(latency),
        "transports": transports(Op.READ, local.mem_type, remote.mem_type, raw=False),
        "raw_transports": transports(Op.READ, local.mem_type, remote.mem_type, raw=True),
    }


def transports(op: Op, local: MemType, remote: MemType, raw: bool) -> list[str]:
    """The transports UCX picked, as this process's agents read it, for ``op`` between
    this process's ``local`` memory and another process's ``remote`` memory: of the raw
    transfers' agents, or of ours (the sender's, the pull client's)."""
    from kv_connector.wire.ucx_choices import ucx_choices

    def mem(m: MemType) -> Mem:
        return Mem.GPU if m == "VRAM" else Mem.HOST

    key = str(Pairing(op, mem(local), mem(remote), Reach.SAME_NODE))
    out: set[str] = set()
    for agent, pairings in ucx_choices().items():
        if agent.startswith(RAW) == raw:
            out.update(pairings.get(key, []))
    return sorted(out)


def pairings(checked: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per pairing of a check: GB/s ours and raw, ours over raw, the transports of
    both, and the time from a sample's finish (push) or handle (pull) to usable."""
    rows = []
    for mode, raw_key, usable in (
        ("push", "raw_write_GBps", "finish_to_usable_ms_median"),
        ("pull", "raw_read_GBps", "fetch_to_usable_ms_median"),
    ):
        if mode not in checked:
            continue
        r = checked[mode]
        kind = {"VRAM": "GPU", "DRAM": "host"}
        mapped = " (node_pool)" if checked.get("node_pool") else ""
        rows.append(
            {
                "pairing": f"{mode}: {kind[r['cache_mem']]} cache -> {kind[r['pool_mem']]} pool{mapped}",
                "ours_GBps": round(r["ours_GBps"], 3),
                "raw_GBps": round(r[raw_key], 3),
                "of_raw": round(r["d"], 3),
                "transports": r["transports"],
                "raw_transports": r["raw_transports"],
                "finish_to_usable_ms": round(r[usable], 3),
            }
        )
    return rows


def gpudirect_probe(device: torch.device) -> dict[str, Any]:
    """What a pool on ``device`` does to make RDMA writes visible (``common.gpudirect``),
    with the GPU's GPUDirect RDMA attributes read through cuda-bindings, and the same
    decision and call made as if the node had an RDMA device: the flush (or synchronize)
    timed where the GPU asks for one."""
    from kv_connector.common import gpudirect

    if device.type != "cuda":
        return {"plan": gpudirect.Visibility(device).plan.value}
    index = device.index if device.index is not None else torch.cuda.current_device()
    attrs = gpudirect.device_rdma(index)
    here = gpudirect.Visibility(device)
    forced = gpudirect.Visibility(device, devices=["(probe)"])

    def per_call_us(call: Callable[[], None]) -> float:
        call()  # the first: any lazy set-up
        t0 = time.perf_counter()
        for _ in range(100):
            call()
        return (time.perf_counter() - t0) / 100 * 1e6

    out: dict[str, Any] = {
        "rdma_devices": gpudirect.node_rdma_devices(),
        "plan": here.plan.value,
        "attributes": asdict(attrs) if attrs is not None else None,
        "plan_with_an_rdma_device": forced.plan.value,
        "visibility_call_us": per_call_us(forced),
    }
    if attrs is not None and attrs.flush_options & gpudirect.OPTION_HOST:

        def flush() -> None:
            with torch.cuda.device(device):
                gpudirect.flush_to_owner()

        out["flush_call_us"] = per_call_us(flush)  # the call itself, whatever the plan
    return out


def check_node_pool(device: torch.device, size: Size) -> dict[str, Any]:
    """Push from a cache on ``device`` into a host pool the reader offers to producers on
    this node (``node_pool``): the sender copies into the mapped pages; against raw UCX
    WRITEs into host memory."""
    out: dict[str, Any] = {
        "size": asdict(size),
        "node_pool": True,
        "push": push(device, size, node_pool=True),
    }
    out["pairings"] = pairings(out)
    return out


def check(device: torch.device, size: Size, pool_device: str | None = None) -> dict[str, Any]:
    """Push and pull from a cache on ``device`` into pools in host memory, or on
    ``pool_device`` (the trainer's GPU)."""
    out: dict[str, Any] = {
        "size": asdict(size),
        "push": push(device, size, pool_device),
        "pull": pull(device, size, pool_device),
    }
    out["pairings"] = pairings(out)
    if pool_device is not None:
        out["gpudirect"] = gpudirect_probe(torch.device(pool_device))
    return out
