"""Data-path ceiling on GPU-sized states (4 captured layers x hidden 4096, bf16: 32 KiB
per token), with no model compute, every ratio from alternating pairs (``scripts.bench.paired``):

  e: our connector's worker side driven with real vLLM objects (scripts.support.vllm_harness)
     into a HiddenStatesReader in another process that takes every sample on lease;
  b: vLLM's ExampleHiddenStatesConnector driven the same way, writing safetensors files
     to /dev/shm (a minimal CPU-safe subclass: the stock one needs CUDA);
  r: a raw NIXL WRITE of the same blocks from the same kind of registered cache into
     another process's registered memory (no protocol, no hand-out).

Each arm is a pair of long-lived processes (producer, consumer) started once; a round is
one measurement on command, so a pair costs the transfer, not vLLM's import. Every round
reports the CPU seconds both processes spent in it (their own rusage), which on a shared
machine is far steadier than bytes per second.

  rc: r with XXH3 at both ends (each sample hashed from the cache as its WRITE is posted,
     and from the pool as it lands, each on a thread of its own): the ceiling of d and
     of the checksum ratio on this machine for any design that checks every byte.

Figures: d = e's bytes/s over r's; cpu_over_raw = e's CPU seconds per GB over r's;
xxh3_ceiling = rc over r, xxh3_cpu_floor = rc's CPU seconds per GB over r's (the least
cpu_over_raw can be for a design that checks every byte);
checksum_throughput_ratio = e over e without checksums; metrics_throughput_ratio = e
(the connector's stats taken every step on both roles as vLLM does, the reader's endpoint
scraped every second) over e with metrics off; e_over_b. Also what the reader's optional
values check (``reader.values``: NaN/Inf, all-zero tokens) costs per sample of the same
shape, beside the XXH3 checksum's pass over the same bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from scripts.bench.paired import Pairs, Run, Spread, cpu_seconds, memory_mib, run_pairs

LAYERS = [1, 2, 3, 4]
HIDDEN = 4096
BLOCK = 128  # vLLM's CPU block size
TOKEN_BYTES = len(LAYERS) * HIDDEN * 2


# ------------------------------------------------------------------ arms in processes
class ArmProcess:
    """One arm in a process of its own (spawned: vLLM's global state is per process),
    built once; ``round()`` runs one measurement there and returns its ``Run`` and the
    arm's own extras; ``close()`` ends it and returns what the arm reports at the end."""

    def __init__(self, cls_name: str, *args: Any) -> None:
        self.name = cls_name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_arm, args=(cls_name, child, *args))
        self._proc.start()
        self._ready = False

    def ready(self) -> ArmProcess:
        if not self._ready:
            self._answer()
            self._ready = True
        return self

    def _answer(self) -> Any:
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"{self.name} died (exit code {self._proc.exitcode})")
        status, payload = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.name} failed:\n{payload}")
        return payload

    def round(self) -> Run:
        self.ready()
        self._conn.send("round")
        got: dict[str, float] = self._answer()
        return Run(got.pop("seconds"), got.pop("units"), got.pop("nbytes"), got.pop("cpu_s"), got)

    def close(self) -> dict[str, float]:
        try:
            self.ready()
            self._conn.send("stop")
            final: dict[str, float] = self._answer()
            return final
        finally:
            self._proc.join(60)
            if self._proc.is_alive():
                self._proc.kill()


def _serve_arm(cls_name: str, conn: Any, *args: Any) -> None:
    try:
        arm = globals()[cls_name](*args)
        conn.send(("ok", None))
        while (cmd := conn.recv()) != "stop":
            assert cmd == "round", cmd
            conn.send(("ok", arm.round()))
        conn.send(("ok", arm.close()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def one_round(cls_name: str, *args: Any) -> dict[str, float]:
    """Build an arm in its own process, run one round, close it: the round's figures and
    the arm's closing report in one dict (what the arms' tests check)."""
    arm = ArmProcess(cls_name, *args)
    try:
        run = arm.round()
    except BaseException:
        arm._proc.kill()
        raise
    final = arm.close()
    return {
        "seconds": run.seconds, "tokens": run.units, "bytes": run.nbytes, "cpu_s": run.cpu_s,
        **run.detail, **final,
    }  # fmt: skip


# ------------------------------------------------------------------ reader process (e)
def _reader_proc(conn: Any, pool_bytes: int, metrics: bool = True, checked: bool = True) -> None:
    """A trainer that takes every sample on lease and lets it go at the next one (what
    ``for sample in reader`` does with a sample the loop body does not keep); with
    ``metrics``, the reader serves its metrics and a scraper reads them every second
    (Prometheus' default is every 15 s). Unless ``checked``, it accepts shares without a
    checksum (the no-checksum arm; by default a reader refuses them from host caches).
    Takes ("take", n) commands: n samples, then (end time, bytes, CPU seconds spent)."""
    import threading

    base = memory_mib()  # python and torch, which a trainer's process holds anyway
    from kv_connector.datagen.httpclient import Server
    from kv_connector.reader import HiddenStatesReader

    with HiddenStatesReader(
        pool_bytes=pool_bytes,
        metrics_address="127.0.0.1:0" if metrics else None,
        require_checksum="auto" if checked else "never",
    ) as reader:
        conn.send(reader.address)
        stop = threading.Event()
        scrapes = [0]

        def scrape() -> None:
            http = Server(f"http://{reader.metrics_address}")
            while not stop.wait(1.0):
                http.get_text("/metrics")
                scrapes[0] += 1

        scraper = threading.Thread(target=scrape, daemon=True)
        if metrics:
            scraper.start()
        while (cmd := conn.recv())[0] == "take":
            c0 = cpu_seconds()
            nbytes = 0
            for s in reader.samples(cmd[1], timeout=300):
                nbytes += s.hidden_states.numel() * s.hidden_states.element_size()
                last = s
            last.let_go()
            conn.send((time.time(), nbytes, cpu_seconds() - c0))
        stop.set()
        stats = reader.stats().as_dict()
        stats["scrapes"] = scrapes[0]
        # VmHWM, not ru_maxrss: a spawned child's ru_maxrss starts at its parent's
        mem = memory_mib()
        stats["rss_mib"] = mem["peak"]
        stats["rss_beyond_torch_mib"] = mem["peak"] - (base["anon"] + base["file"] + base["shmem"])
        stats.update({f"rss_{k}_mib": v for k, v in mem.items() if k != "peak"})
        conn.send(stats)


def _drive(rank: Any, n_req: int, tokens: int, prefix: str = "q") -> float:
    """Admit requests as blocks free up, step until every one is reported sent."""
    pending = [f"{prefix}{i}" for i in range(n_req)]
    done: set[str] = set()
    prompt = list(range(tokens))
    t0 = time.time()
    while len(done) < n_req:
        admitted = False
        while pending and rank.can_admit(tokens):
            rank.add(pending.pop(0), prompt)
            admitted = True
        finished = rank.step().finished_sending
        done |= finished
        if not admitted and not finished:
            time.sleep(0.0005)  # an idle engine step; a real engine would not spin either
    return t0


class OursArm:
    """e: our connector's worker side (real vLLM objects, no model) into a reader process."""

    def __init__(
        self,
        model_dir: Path,
        n_req: int,
        tokens: int,
        num_blocks: int,
        pool_bytes: int,
        checksum: str = "xxh3",
        metrics: bool = True,
    ) -> None:
        from kv_connector.connector import HiddenStatesConnector
        from scripts.support.vllm_harness import ProducerRank, engine_config, start_worker

        self.n_req, self.tokens, self.pool_bytes = n_req, tokens, pool_bytes
        ctx = mp.get_context("spawn")
        self.conn, b = ctx.Pipe()
        self.proc = ctx.Process(target=_reader_proc, args=(b, pool_bytes, metrics, checksum != "none"))
        self.proc.start()
        address = self.conn.recv()
        cfg = engine_config(
            model_dir,
            LAYERS,
            {
                "kv_connector": "HiddenStatesConnector",
                "kv_connector_module_path": "kv_connector.connector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"consumer_address": address, "checksum": checksum},
            },
        )
        self._vllm_worker = start_worker(cfg)
        self.rank = ProducerRank(
            cfg, HiddenStatesConnector, num_blocks=num_blocks, block_size=BLOCK, metrics=metrics
        )
        self.rank.kv.copy_(torch.randn(self.rank.kv.shape, dtype=torch.bfloat16))
        assert self.rank.worker.wait_connected(30)
        self.rounds = 0
        self._take(1, "warmup")  # connection set-up and first touch out of the timing

    def _take(self, n: int, prefix: str) -> tuple[float, float, float, float, float]:
        self.conn.send(("take", n))
        c0 = cpu_seconds()
        t0 = _drive(self.rank, n, self.tokens, prefix=prefix)
        failed = self.rank.worker.recent_failures()
        if failed:  # the reader would wait for samples that never come
            self.proc.kill()
            raise RuntimeError(f"{len(failed)} requests failed, e.g. {next(iter(failed.items()))}")
        t_end, nbytes, reader_cpu = self.conn.recv()
        return t0, t_end, nbytes, cpu_seconds() - c0, reader_cpu

    def round(self) -> dict[str, float]:
        self.rounds += 1
        t0, t_end, nbytes, producer_cpu, reader_cpu = self._take(self.n_req, f"r{self.rounds}-")
        return {
            "seconds": t_end - t0, "units": float(self.n_req * self.tokens), "nbytes": float(nbytes),
            "cpu_s": producer_cpu + reader_cpu, "producer_cpu_s": producer_cpu, "reader_cpu_s": reader_cpu,
        }  # fmt: skip

    def close(self) -> dict[str, float]:
        sender_stats = self.rank.worker.sender_stats()[0].as_dict()
        steps_with_stats = self.rank.steps_with_stats
        self.rank.shutdown()  # first, so that it does not try to reach the closed reader
        self.conn.send(("stop",))
        reader_stats = self.conn.recv()
        self.proc.join(30)
        return {
            "reader_copy_out_s": reader_stats["copy_s"],
            "reader_rss_mib": reader_stats["rss_mib"],
            **{f"reader_{k}": v for k, v in reader_stats.items() if k.startswith("rss_")},
            "reader_pool_mib": self.pool_bytes / (1 << 20),
            "reader_verify_s": reader_stats["verify_s"],
            "reader_scrapes": float(reader_stats["scrapes"]),
            "sender_write_s": sender_stats["write_s"],
            "sender_checksum_s": sender_stats["checksum_s"],
            "steps_with_stats": float(steps_with_stats),
        }


def _cpu_example_connector() -> type:
    """vLLM's ExampleHiddenStatesConnector made CPU-safe (``scripts.support.cpu_example_connector``)."""
    from scripts.support.cpu_example_connector import CpuExampleHiddenStatesConnector

    return CpuExampleHiddenStatesConnector


class ExampleArm:
    """b: vLLM's ExampleHiddenStatesConnector (made CPU-safe) into files on /dev/shm."""

    def __init__(self, model_dir: Path, n_req: int, tokens: int, num_blocks: int) -> None:
        from scripts.support.vllm_harness import ProducerRank, engine_config, start_worker

        self.n_req, self.tokens = n_req, tokens
        self.out_dir = Path(tempfile.mkdtemp(prefix="hs-example-", dir="/dev/shm"))
        cls = _cpu_example_connector()
        cfg = engine_config(
            model_dir,
            LAYERS,
            {
                "kv_connector": "ExampleHiddenStatesConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(self.out_dir)},
            },
        )
        self._vllm_worker = start_worker(cfg)
        self.rank = ProducerRank(cfg, cls, num_blocks=num_blocks, block_size=BLOCK)
        self.rank.kv.copy_(torch.randn(self.rank.kv.shape, dtype=torch.bfloat16))
        self.rounds = 0
        self._write(1, "warmup")

    def _write(self, n: int, prefix: str) -> float:
        c0 = cpu_seconds()
        t0 = _drive(self.rank, n, self.tokens, prefix=prefix)
        for fut in list(self.rank.worker._req_futures.values()):
            fut.result()
        seconds = time.time() - t0
        files = [f for f in self.out_dir.rglob("*.safetensors")]
        assert len(files) == n, (len(files), n)
        for f in files:
            f.unlink()
        self.cpu_s = cpu_seconds() - c0
        return seconds

    def round(self) -> dict[str, float]:
        self.rounds += 1
        seconds = self._write(self.n_req, f"r{self.rounds}-")
        return {
            "seconds": seconds, "units": float(self.n_req * self.tokens),
            "nbytes": float(self.n_req * self.tokens * TOKEN_BYTES), "cpu_s": self.cpu_s,
        }  # fmt: skip

    def close(self) -> dict[str, float]:
        self.rank.worker._executor.shutdown(wait=True)
        shutil.rmtree(self.out_dir, ignore_errors=True)
        return {}


# ------------------------------------------------------------------ raw NIXL (r)
def raw_target_proc(conn: Any, pool_bytes: int, checks: bool = False) -> None:
    """Registers a pool, then on ("expect", n, sample_bytes) polls until n WRITEs notified
    and answers (end time, CPU seconds spent). With ``checks``, each landed sample (the
    slot its notification names) is hashed (XXH3) on a thread of its own, as the reader's
    checker does, and the answer waits for the last hash."""
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
    credits), the ceiling of e over r."""

    def __init__(
        self, n_req: int, tokens: int, num_blocks: int, in_flight: int, checks: bool = False
    ) -> None:
        from kv_connector.wire.nixl_transport import NixlTransport
        from kv_connector.wire.transport import Region

        self.n_req, self.tokens, self.num_blocks, self.in_flight = n_req, tokens, num_blocks, in_flight
        self.block_bytes = BLOCK * TOKEN_BYTES
        self.nb = -(-tokens // BLOCK)
        pool_bytes = in_flight * self.nb * self.block_bytes
        self.cache = torch.randn(num_blocks, len(LAYERS), BLOCK, HIDDEN, dtype=torch.bfloat16)
        self._hasher = ThreadPoolExecutor(1) if checks else None
        ctx = mp.get_context("spawn")
        self.conn, b = ctx.Pipe()
        self.proc = ctx.Process(target=raw_target_proc, args=(b, pool_bytes, checks))
        self.proc.start()
        md, addr, size = self.conn.recv()
        self.t = NixlTransport(f"raw-init-{os.getpid()}")
        self.local = self.t.register(self.cache)
        self.conn.send(self.t.metadata)
        self.peer = self.t.add_peer(md)
        self.remote = Region(addr, size, "DRAM", 0)
        self.next = 0
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

    def _writes(self, n: int) -> tuple[float, float, float]:
        sample_bytes = self.nb * self.block_bytes
        self.conn.send(("expect", n, sample_bytes))
        c0 = cpu_seconds()
        t0 = time.time()
        live: list[Any] = []
        hashes = []
        end = self.next + n
        while self.next < end or live:
            while self.next < end and len(live) < self.in_flight:
                if self._hasher is not None:
                    hashes.append(self._hasher.submit(self._hash, self.next))
                slot = str(self.next % self.in_flight).encode()
                live.append(self.t.write(self.peer, self.local, self.remote, self._spans(self.next), slot))
                self.next += 1
            still = [x for x in live if not self.t.poll(x)]
            if still and len(still) == len(live):
                time.sleep(0)  # nothing completed: let the hashing thread have the GIL, do not spin
            live = still
        for h in hashes:
            h.result()
        t_end, target_cpu = self.conn.recv()
        return t_end - t0, cpu_seconds() - c0, target_cpu

    def round(self) -> dict[str, float]:
        seconds, init_cpu, target_cpu = self._writes(self.n_req)
        return {
            "seconds": seconds, "units": float(self.n_req * self.tokens),
            "nbytes": float(self.n_req * self.nb * self.block_bytes), "cpu_s": init_cpu + target_cpu,
            "producer_cpu_s": init_cpu, "reader_cpu_s": target_cpu,
        }  # fmt: skip

    def close(self) -> dict[str, float]:
        self.conn.send(("stop",))
        self.proc.join(30)
        self.t.close()
        if self._hasher is not None:
            self._hasher.shutdown()
        return {}


def bench_values_check(tokens: int, rounds: int = 5) -> dict[str, float]:
    """The values check on one thread over a sample as the reader hands it out: a strided
    [T, L, H] view of layer-major pages (vLLM's CPU block layout, as in e), and a plain
    tensor (the GPU layout); XXH3 over the same bytes for scale. Best of ``rounds``."""
    import xxhash

    from kv_connector.reader import find_bad_values

    torch.set_num_threads(1)
    nbytes = tokens * len(LAYERS) * HIDDEN * 2
    lth = torch.randn(len(LAYERS), tokens, HIDDEN).to(torch.bfloat16).permute(1, 0, 2)
    tlh = torch.randn(tokens, len(LAYERS), HIDDEN).to(torch.bfloat16)

    def best(fn: Any) -> float:
        fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    cpu = best(lambda: find_bad_values(lth, LAYERS))
    gpu = best(lambda: find_bad_values(tlh, LAYERS))
    raw = tlh.view(-1).view(torch.uint8).numpy()
    xxh = best(lambda: xxhash.xxh3_64_intdigest(raw.data))
    return {
        "sample_mib": nbytes / (1 << 20),
        "ms_per_sample_cpu_layout": cpu * 1e3,
        "ms_per_sample_gpu_layout": gpu * 1e3,
        "GB_per_s": nbytes / cpu / 1e9,
        "xxh3_GB_per_s": nbytes / xxh / 1e9,
    }


def _run(fn_name: str, conn: Any, *args: Any) -> None:
    conn.send(globals()[fn_name](*args))


def isolated(fn_name: str, *args: Any) -> dict[str, float]:
    """Run one function in a fresh process."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_run, args=(fn_name, b, *args))
    p.start()
    while not a.poll(1.0):
        if not p.is_alive():
            raise RuntimeError(f"{fn_name} died (exit code {p.exitcode})")
    res: dict[str, float] = a.recv()
    p.join(60)
    return res


def _say(text: str) -> None:
    print(f"[bench.datapath {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main(n_req: int = 48, tokens: int = 2048, pairs: int = 7) -> dict[str, Any]:
    from scripts.support.vllm_harness import config_only_model

    work = Path(tempfile.mkdtemp(prefix="hs-bench-"))
    model = config_only_model(work / "wide-llama", HIDDEN, num_layers=4)
    nb = -(-tokens // BLOCK)
    num_blocks = 4 * nb + 1
    pool = 4 * nb * BLOCK * TOKEN_BYTES
    arms = {
        "e": ArmProcess("OursArm", model, n_req, tokens, num_blocks, pool),
        "e0": ArmProcess("OursArm", model, n_req, tokens, num_blocks, pool, "none"),
        "em": ArmProcess("OursArm", model, n_req, tokens, num_blocks, pool, "xxh3", False),
        "r": ArmProcess("RawArm", n_req, tokens, num_blocks, 4),
        "rc": ArmProcess("RawArm", n_req, tokens, num_blocks, 4, True),
        "b": ArmProcess("ExampleArm", model, n_req, tokens, num_blocks),
    }
    finals: dict[str, dict[str, float]] = {}
    try:
        for arm in arms.values():
            arm.ready()
        _say(f"arms ready; {pairs} pairs per ratio, {n_req} samples of {tokens} tokens a round")
        e = arms["e"]
        measured: dict[str, Pairs] = {}
        for other in ("r", "e0", "em", "b"):
            measured[other] = run_pairs(e.round, arms[other].round, pairs)
            _say(f"e vs {other}: {[round(x, 3) for x in measured[other].ratio().values]}")
        # the machine's ceiling for e over r: raw WRITEs with XXH3 at both ends, no protocol
        measured["rc"] = run_pairs(arms["rc"].round, arms["r"].round, pairs)
        _say(f"rc vs r: {[round(x, 3) for x in measured['rc'].ratio().values]}")
    finally:
        for name, arm in arms.items():
            try:
                finals[name] = arm.close()
            except Exception as exc:  # report it, and close the others
                _say(f"closing {name}: {exc}")
        shutil.rmtree(work, ignore_errors=True)

    def gb(r: Run) -> float:
        return r.gb_per_s

    def per_gb(r: Run) -> float:
        return r.cpu_s_per_gb

    d = measured["r"]
    e_runs = [r for name, p in measured.items() if name != "rc" for r in p.a]
    out: dict[str, Any] = {
        "d": d.ratio(gb),
        "cpu_over_raw": d.ratio(per_gb),
        "checksum_throughput_ratio": measured["e0"].ratio(),
        "metrics_throughput_ratio": measured["em"].ratio(),
        "e_over_b": measured["b"].ratio(),
        "e_GB_per_s": Spread.of([gb(r) for r in e_runs]),
        "e_tokens_per_s": Spread.of([r.rate for r in e_runs]),
        "raw_nixl_GB_per_s": d.each("b", gb),
        "b_tokens_per_s": measured["b"].each("b"),
        "e0_GB_per_s": measured["e0"].each("b", gb),
        "cpu_s_per_GB": Spread.of([per_gb(r) for r in e_runs]),
        "raw_cpu_s_per_GB": d.each("b", per_gb),
        "e0_cpu_s_per_GB": measured["e0"].each("b", per_gb),
        "xxh3_ceiling": measured["rc"].ratio(gb),
        "xxh3_cpu_floor": measured["rc"].ratio(per_gb),
    }
    for end in ("producer", "reader"):
        key = f"{end}_cpu_s"
        out[f"{end}_cpu_s_per_GB"] = Spread.of([r.detail[key] / (r.nbytes / 1e9) for r in e_runs])
        out[f"e0_{end}_cpu_s_per_GB"] = Spread.of(
            [r.detail[key] / (r.nbytes / 1e9) for r in measured["e0"].b]
        )
        out[f"raw_{end}_cpu_s_per_GB"] = Spread.of([r.detail[key] / (r.nbytes / 1e9) for r in d.b])
    out["e_final"] = finals.get("e", {})
    vc = isolated("bench_values_check", tokens)
    out["values_check"] = vc
    return out
