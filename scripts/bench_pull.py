"""Pull delivery, measured in pairs (``scripts.paired``: alternating A/B rounds after a
warm-up pair, the median ratio with its min and max):

``pull_read_over_raw``: our ``PullClient`` fetching samples by their handles (several in
flight, ``fetch_iter``: the control round trips, the producer's XXH3 and the client's
check of it, the values check, each sample taken and let go) over a raw NIXL READ of the
same block spans between the same two processes (no protocol, no checks), in GB/s. The
producer is a ``PullServer`` over a cache tensor (no vLLM) at GPU-like shape: 4 captured
layers x hidden 4096 bf16, GPU block layout (TLH), block 128, 2048-token samples (64 MiB
each) in scattered blocks, held again every round; the consumer does both arms, the raw
one into a registered buffer of the client's pool size, ``IN_FLIGHT`` READs at a time.
During the raw arm the producer's own progress thread polls as it does while a consumer
reads (this NIXL runs without a progress thread). Each arm also reports the CPU seconds
per GB of both processes (their rusage over the round), and the milliseconds per sample of
the client's checks measured in the consumer. ``read_unchecked`` is the same pairing with
the checks off at both ends (producer ``checksum=False``, client ``check_values=False``):
what the protocol itself costs over the raw READ.

``checked_raw_over_raw``: the same raw READs with the client's checks (XXH3 and the values
check of each sample on a thread of its own as its READ completes) while the producer
hashes its samples in the background, as the server does, over the plain raw READs: the
least any design with those checks pays on this machine (no protocol), the ceiling of
``pull_read_over_raw``.

``pull_over_file``: rows/s through speculators' own DataLoader
(``create_train_val_loaders(..., on_missing="generate", num_workers=12)``, speculators'
default) with our ``kv-hidden-states`` backend (the rank's fetch agent, its default)
against a vLLM OpenAI server in pull delivery, over the same
with speculators' ``file`` backend against an identical server whose connector is vLLM's
ExampleHiddenStatesConnector made CPU-safe (``scripts.cpu_example_connector``), writing
its safetensors files to a temporary directory on local disk (``tempfile``'s default,
/tmp). Both servers run the same flags: a Llama of hidden 4096 whose compute is tiny (1
attention head of dim 64, intermediate size 64, 4 layers, vocabulary 1024, random
weights: ``--load-format dummy``), bf16, 4 captured layers (1, 2, 3 and the last, 4),
``ROW_TOKENS``-token rows (16 MiB each), block 128. A round is one epoch of ``ROWS`` rows.
Two loaders (one trainer rank each) are alive at a time.

``rank_agent_over_worker_clients``: the same DataLoader on the same pull server, the
rank's one fetch agent (``--kv-hs-fetch-agent rank``) over a client per worker
(``worker``), rows/s; and for each, what fetches for the rank (``Loader.consumers``): the
processes that made a NIXL agent (``scripts.proc_tree``), the consumer agents the
producer logged serving the rank's processes with the pool each registered, and the
rank's processes' memory (PSS). The profile says where
a row's time goes: the server's request time (queue, prefill) from its /metrics, and the
DataLoader workers' time in the transfer's ``get_generated`` and ``delete``
(``scripts.bench_pull_transfer`` times the backend's transfer).

``manifest_only_over_file``: the same DataLoader with the pull backend less its data
(``scripts.bench_pull_transfer.ManifestOnly``: the row's manifest asked for, the sample
released, a constant tensor of its shape returned; nothing READ, copied or checked) over
the file backend: speculators' own work per row and the server's, around a transfer that
costs nothing, the ceiling of ``pull_over_file`` on this machine.

``python -m scripts.bench_pull`` prints progress to stderr and the result JSON as its
last stdout line (``--loader``: the DataLoader pairings only; ``--read``: the READ
pairings only). Every process it starts is stopped before it returns.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from scripts import paired
from scripts.proc_tree import descendants, made_a_nixl_agent, pss_mib, spawned_workers

REPO = Path(__file__).resolve().parents[1]
# where scripts/setup_env.sh installs speculators (as tests/e2e/test_speculators.py finds it)
SPECULATORS_SITE = Path(os.environ.get("SPECULATORS_SITE") or Path(sys.prefix) / "speculators-site-packages")
UDS_SITE = REPO / "tests" / "e2e" / "uds_site"  # openai clients over the server's Unix socket

HIDDEN = 4096
LAYER_IDS = [1, 2, 3, 4]  # 4 captured layers: auxiliary 1, 2, 3 and the last (4 of 4)
BLOCK = 128
TOKENS = 2048
SAMPLES = 24  # samples per round of pull_read_over_raw
IN_FLIGHT = 4  # samples in flight (the client's pool holds this many)
ROWS = 96  # rows per round of the DataLoader pairings
LOADER_PAIRS = 7  # rounds of a dozen seconds, two cores shared by 12 workers, a server and the rank
WORKER_POOL_MIB = 64  # the per-worker clients' pools here: 4 rows (12 x the default 256 does not fit beside)
WORKERS = 12  # DataLoader workers per loader (one trainer rank): speculators' default
# tokens per DataLoader row: 16 MiB rows, so that two loaders of 12 workers and a server fit
# this machine's 23 GiB (at 64 MiB rows the per-worker clients' loader alone holds 8.9 GiB,
# the fetch agent's 6.8 GiB; at 32 MiB rows both and the server still ran out of memory)
ROW_TOKENS = 512
SERVED = re.compile(r"serves consumer agent (kvhs-[a-z]+-(\d+)-[0-9a-f]+) \(a (\d+) MiB pool\)")
NULL_ARM = "manifest-only"  # the loader arm of the pull backend less its data
PAIRS = 5
WARMUP = 1
SERVER_KV_BYTES = 1 << 30
SERVER_START_S = 300.0
SERVER_METRICS = {  # vLLM's request-time sums (seconds, over the round's requests)
    "vllm:e2e_request_latency_seconds_sum": "server_request_s",
    "vllm:request_queue_time_seconds_sum": "server_queue_s",
    "vllm:request_prefill_time_seconds_sum": "server_prefill_s",
}


def log(msg: str) -> None:
    print(f"[bench_pull {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# pull_read_over_raw: a producer process and a consumer process, commands over pipes


def _serve_commands(conn: Any, handlers: dict[str, Callable[..., Any]]) -> None:
    """Answer ``(name, *args)`` messages until "quit"; an exception goes back as
    ("error", traceback) instead of killing the process silently."""
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[msg[0]](*msg[1:])))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _sample_tokens(i: int, n: int) -> list[int]:
    return [(i * 131 + k * 7) % 1000 for k in range(n)]


def _digest(data: Any) -> str:
    import xxhash

    return str(xxhash.xxh3_64_hexdigest(memoryview(data)))


def _producer_proc(conn: Any, samples: int, tokens: int, hidden: int, seed: int, checksum: bool) -> None:
    """A ``PullServer`` over a cache of ``samples`` samples' blocks (scattered), holding
    them again on every "hold"."""
    import torch

    from kv_connector.producer.pull_server import PullServer
    from kv_connector.wire.handle import PullHandle, make_nonce
    from kv_connector.wire.layout import BlockLayout
    from kv_connector.wire.protocol import ShareChecksum

    layout = BlockLayout(
        layout="TLH", block_size=BLOCK, num_layers=len(LAYER_IDS), hidden_size=hidden, dtype="bfloat16"
    )
    nb = layout.blocks_for(tokens)
    num_blocks = samples * nb + 1
    cache = torch.empty(num_blocks, *layout.block_shape(), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    cache[:1].uniform_(0.5, 1.5, generator=g)
    for b in range(1, num_blocks):  # finite, non-zero, every block different
        cache[b].copy_(cache[0]).add_(b / num_blocks)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 unused
    blocks = [order[i * nb : (i + 1) * nb] for i in range(samples)]
    server = PullServer(
        cache,
        layout,
        LAYER_IDS,
        "bench-producer",
        0,
        1,
        ("127.0.0.1", 0),
        300.0,
        checksum=ShareChecksum.XXH3 if checksum else None,  # a host cache's default
    )
    rounds = 0

    def hold() -> list[str]:
        nonlocal rounds
        rounds += 1
        handles, rids = [], []
        for i, bl in enumerate(blocks):
            rid, nonce = f"round{rounds}-sample{i}", make_nonce()
            server.hold(rid, nonce, _sample_tokens(i, tokens), bl)
            rids.append(rid)
            handles.append(PullHandle("bench-producer", rid, nonce, [server.address]).encode())
        server.finished(rids)
        return handles

    def poll() -> tuple[int, int]:
        return len(server.take_freed()), server.held

    def raw(begin: bool, hashed: bool = False) -> None:
        # the server's own progress thread polls while consumers read; the raw READs get
        # the same (this NIXL has no progress thread: a target that never polls stalls);
        # ``hashed``: the samples are hashed (XXH3) on a thread of their own from now on,
        # as the server hashes each share it holds in the background
        server._reading_changed(+1 if begin else -1)
        if begin and hashed:
            import threading

            from kv_connector.wire.integrity import block_checksum

            raw_bytes = cache.view(-1).view(torch.uint8).numpy().data
            bb = layout.block_bytes

            def hash_all() -> None:
                for bl in blocks:
                    block_checksum(raw_bytes, ((k, b * bb) for k, b in enumerate(bl)), lambda _j: [(0, bb)])

            threading.Thread(target=hash_all, daemon=True).start()

    def digests() -> list[str]:
        """Each sample's bytes as [T, L, H] (its blocks in order, its tokens only)."""
        row = len(LAYER_IDS) * hidden * 2
        flat = [cache[bl].contiguous().view(torch.uint8).numpy().reshape(-1) for bl in blocks]
        return [_digest(f[: tokens * row]) for f in flat]

    info = {
        "metadata": server._transport.metadata,
        "addr": server._region.addr,
        "nbytes": server._region.nbytes,
        "block_bytes": layout.block_bytes,
        "blocks": blocks,
        "cache_bytes": cache.numel() * cache.element_size(),
    }
    try:
        _serve_commands(
            conn,
            {
                "info": lambda: info,
                "hold": hold,
                "poll": poll,
                "raw": raw,
                "cpu": paired.cpu_seconds,
                "digests": digests,
            },
        )
    finally:
        server.close()


def _consumer_proc(conn: Any, pool_bytes: int, in_flight: int, check_values: bool) -> None:
    """Both arms' consumer: a ``PullClient`` (defaults: checksums checked, values checked,
    samples on lease) and a raw NIXL agent with a registered buffer of the same size."""
    import numpy as np
    import torch

    from kv_connector.reader.pull import FetchError, PullClient
    from kv_connector.wire.nixl_transport import NixlTransport
    from kv_connector.wire.transport import Region

    client = PullClient(pool_bytes=pool_bytes, check_values=check_values)
    from kv_connector.common.memory import host_memory

    raw = NixlTransport(f"bench-raw-{os.getpid()}")
    buf_np = host_memory(pool_bytes)  # the same kind of memory as the client's pool
    buf = torch.from_numpy(buf_np)
    local = raw.register(buf)
    state: dict[str, Any] = {}

    def setup(info: dict[str, Any]) -> None:
        state["peer"] = raw.add_peer(info["metadata"])
        state["remote"] = Region(info["addr"], info["nbytes"], "DRAM", 0)
        state["block_bytes"] = info["block_bytes"]

    def pull(handles: list[str], verify: bool) -> tuple[float, int, float, list[str]]:
        moved, digests = 0, []
        c0, t0 = paired.cpu_seconds(), time.perf_counter()
        for s in client.fetch_iter(handles, in_flight):  # in_flight READs ahead, checks beside them
            if isinstance(s, FetchError):
                raise s
            hs = s.hidden_states
            moved += -(-hs.shape[0] // BLOCK) * state["block_bytes"]  # what was READ: whole blocks
            if verify:
                digests.append(_digest(hs.contiguous().view(torch.uint8).numpy().reshape(-1)))
            del hs
            s.release()
        t1 = time.perf_counter()
        return t1 - t0, moved, paired.cpu_seconds() - c0, digests

    checker = ThreadPoolExecutor(1)

    def check(at: int, tokens: int, hidden: int) -> None:
        """What the client checks of a sample: XXH3 of its bytes and the values check."""
        import xxhash

        from kv_connector.reader.values import find_bad_values

        row = len(LAYER_IDS) * hidden * 2
        xxhash.xxh3_64_intdigest(buf_np[at : at + tokens * row].data)
        states = buf[at : at + tokens * row].view(torch.bfloat16).view(tokens, len(LAYER_IDS), hidden)
        assert find_bad_values(states, LAYER_IDS) is None

    def read_raw(
        blocks: list[list[int]], tokens: int, verify: bool, checks: bool = False
    ) -> tuple[float, int, float, list[str]]:
        """Plain READs of each sample's blocks, ``in_flight`` at a time; with ``checks``,
        each sample is checked as the client checks it (``check``) on a thread of its own
        once its READ completed, and its slot is read into again only after that."""
        bb = state["block_bytes"]
        sample_bytes = len(blocks[0]) * bb
        slots = pool_bytes // sample_bytes
        if slots < 1:
            raise ValueError("the buffer holds no sample")
        row = sample_bytes // (len(blocks[0]) * BLOCK)
        hidden = row // (len(LAYER_IDS) * 2)
        checking: list[tuple[Any, int]] = []
        moved, digests = 0, []
        live: list[tuple[Any, int, int]] = []  # (transfer, sample, slot)
        free = list(range(min(slots, in_flight)))
        c0, t0 = paired.cpu_seconds(), time.perf_counter()
        i = 0
        while i < len(blocks) or live or checking:
            while i < len(blocks) and free:
                slot = free.pop()
                at = slot * sample_bytes
                spans = np.array([(at + k * bb, b * bb, bb) for k, b in enumerate(blocks[i])])
                live.append((raw.read(state["peer"], local, state["remote"], spans), i, slot))
                i += 1
            still = []
            for x, j, slot in live:
                if raw.poll(x):
                    moved += sample_bytes
                    if verify:
                        at = slot * sample_bytes
                        digests.append((j, _digest(buf_np[at : at + tokens * row])))
                    if checks:
                        checking.append((checker.submit(check, slot * sample_bytes, tokens, hidden), slot))
                    else:
                        free.append(slot)
                else:
                    still.append((x, j, slot))
            live = still
            if checking and not live and (not free or i >= len(blocks)):
                checking[0][0].result()  # nothing to READ until a check ends: wait, do not spin
            for f, slot in [c for c in checking if c[0].done()]:
                f.result()
                checking.remove((f, slot))
                free.append(slot)
        for f, _slot in checking:
            f.result()
        t1 = time.perf_counter()
        return t1 - t0, moved, paired.cpu_seconds() - c0, [d for _, d in sorted(digests)]

    def profile(tokens: int, hidden: int) -> dict[str, float]:
        """Milliseconds per sample of the client's two checks (best of 3): the XXH3 of the
        bytes (``wire.integrity``'s hash; the producer hashes the share once more on its side
        before answering) and the values check, beside a plain copy of the same bytes."""
        import xxhash

        from kv_connector.reader.values import find_bad_values

        x = torch.empty(tokens, len(LAYER_IDS), hidden, dtype=torch.bfloat16).uniform_(0.5, 1.5)
        y = torch.empty_like(x)
        raw_bytes = x.view(torch.uint8).numpy().reshape(-1).data

        def best(fn: Callable[[], object]) -> float:
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return round(min(times) * 1e3, 2)

        return {
            "xxh3_ms": best(lambda: xxhash.xxh3_64_intdigest(raw_bytes)),
            "values_check_ms": best(lambda: find_bad_values(x, LAYER_IDS)),
            "copy_ms": best(lambda: y.copy_(x)),
        }

    try:
        _serve_commands(conn, {"setup": setup, "pull": pull, "raw": read_raw, "profile": profile})
    finally:
        checker.shutdown()
        client.close()
        raw.close()


class _Child:
    """A spawned process answering commands over a pipe."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *msg: Any, timeout_s: float = 300.0) -> Any:
        self.conn.send(msg)
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"{msg[0]}: the process died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{msg[0]}: no answer in {timeout_s} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{msg[0]} failed in the child:\n{value}")
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.call("quit", timeout_s=30)
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


class PullVsRaw:
    """The two arms of ``pull_read_over_raw`` over one producer and one consumer process.
    ``verify``: every round also compares each sample's bytes with the producer's cache
    (slow; for tests)."""

    def __init__(
        self,
        samples: int = SAMPLES,
        tokens: int = TOKENS,
        hidden: int = HIDDEN,
        in_flight: int = IN_FLIGHT,
        verify: bool = False,
        seed: int = 5,
        checks: bool = True,
    ) -> None:
        self.tokens, self.verify = tokens, verify
        sample_bytes = -(-tokens // BLOCK) * BLOCK * len(LAYER_IDS) * hidden * 2
        self.pool_bytes = in_flight * sample_bytes
        self.producer = _Child(_producer_proc, samples, tokens, hidden, seed, checks)
        self.consumer: _Child | None = None
        try:
            self.info = self.producer.call("info")
            self.consumer = _Child(_consumer_proc, self.pool_bytes, in_flight, checks)
            self.consumer.call("setup", self.info)
            self.expected = self.producer.call("digests") if verify else []
        except BaseException:
            self.close()
            raise
        arms = ("pull", "raw", "raw_checked")
        self.cpu: dict[str, dict[str, list[float]]] = {arm: {"producer": [], "consumer": []} for arm in arms}
        self.gb: dict[str, list[float]] = {arm: [] for arm in arms}

    def _record(self, arm: str, secs: float, nbytes: int, ccpu: float, pcpu: float) -> paired.Run:
        self.cpu[arm]["consumer"].append(ccpu)
        self.cpu[arm]["producer"].append(pcpu)
        run = paired.Run(secs, self.tokens * len(self.info["blocks"]), float(nbytes), ccpu + pcpu)
        self.gb[arm].append(nbytes / 1e9)
        return run

    def pull(self) -> paired.Run:
        assert self.consumer is not None
        handles = self.producer.call("hold")
        p0 = self.producer.call("cpu")
        secs, nbytes, ccpu, digests = self.consumer.call("pull", handles, self.verify)
        p1 = self.producer.call("cpu")
        _freed, held = self.producer.call("poll")
        if held:
            raise RuntimeError(f"the producer still holds {held} samples after the round")
        if self.verify and digests != self.expected:
            raise RuntimeError("fetched bytes differ from the producer's cache")
        return self._record("pull", secs, nbytes, ccpu, p1 - p0)

    def raw(self, checks: bool = False) -> paired.Run:
        """Plain READs; with ``checks`` (the ceiling arm), the producer hashes its samples in
        the background and the consumer checks each as the client does."""
        assert self.consumer is not None
        self.producer.call("raw", True, checks)
        try:
            p0 = self.producer.call("cpu")
            secs, nbytes, ccpu, digests = self.consumer.call(
                "raw", self.info["blocks"], self.tokens, self.verify, checks
            )
            p1 = self.producer.call("cpu")
        finally:
            self.producer.call("raw", False)
        if self.verify and digests != self.expected:
            raise RuntimeError("raw READ bytes differ from the producer's cache")
        return self._record("raw_checked" if checks else "raw", secs, nbytes, ccpu, p1 - p0)

    def raw_checked(self) -> paired.Run:
        return self.raw(checks=True)

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.stop()
        self.producer.stop()


def _spread(values: list[float]) -> dict[str, Any]:
    s = paired.Spread.of(values)
    med, rng = s.rounded()
    return {"median": med, "range": rng}


def bench_read(pairs: int = PAIRS, warmup: int = WARMUP, **kw: Any) -> dict[str, Any]:
    b = PullVsRaw(**kw)
    try:
        checks_on = kw.get("checks", True)
        checks = "on" if checks_on else "off (no checksum, no values check)"
        n = len(b.info["blocks"])
        log(f"pull vs raw READ: {n} samples of {b.tokens} tokens per round, checks {checks}")
        p = paired.run_pairs(b.pull, b.raw, pairs=pairs, warmup=warmup)
        # the machine's ceiling: raw READs with the same checks at both ends, no protocol
        c = paired.run_pairs(b.raw_checked, b.raw, pairs=pairs, warmup=warmup) if checks_on else None
        assert b.consumer is not None
        prof = b.consumer.call("profile", b.tokens, kw.get("hidden", HIDDEN))
    finally:
        b.close()

    def arm(name: str, runs: list[paired.Run]) -> dict[str, Any]:
        n = len(runs)
        cpu = {
            who: _spread([c / (r.nbytes / 1e9) for c, r in zip(b.cpu[name][who][-n:], runs, strict=True)])
            for who in ("consumer", "producer")
        }
        return {
            "GB_per_s": _spread([r.gb_per_s for r in runs]),
            "cpu_s_per_GB": cpu,
            "GB_per_round": round(runs[0].nbytes / 1e9, 3),
        }

    ratio = p.ratio(lambda r: r.gb_per_s)
    med, rng = ratio.rounded()
    ceiling = c.ratio(lambda r: r.gb_per_s).rounded() if c is not None else None
    return {
        "pull_read_over_raw": med,
        "range": rng,
        "checked_raw_over_raw": ceiling[0] if ceiling else None,
        "checked_raw_range": ceiling[1] if ceiling else None,
        "pull": arm("pull", p.a),
        "raw": arm("raw", p.b),
        "samples_per_round": len(b.info["blocks"]),
        "sample_MiB": round(p.a[0].nbytes / len(b.info["blocks"]) / (1 << 20), 1),
        "in_flight": kw.get("in_flight", IN_FLIGHT),
        "checks": kw.get("checks", True),
        "ms_per_sample": {
            "pull": round(statistics.median(r.seconds for r in p.a) / len(b.info["blocks"]) * 1e3, 2),
            "raw": round(statistics.median(r.seconds for r in p.b) / len(b.info["blocks"]) * 1e3, 2),
            **prof,
        },
        "layout": f"TLH (GPU), bf16, 4 layers x hidden {kw.get('hidden', HIDDEN)}, block {BLOCK}",
    }


# --------------------------------------------------------------------------------------
# pull_over_file: two vLLM OpenAI servers, speculators' DataLoader in a process of its own


def tiny_compute_model(out: Path, hidden: int = HIDDEN) -> Path:
    from scripts.vllm_harness import config_only_model

    return config_only_model(
        out, hidden, num_layers=4, num_attention_heads=1, num_key_value_heads=1, head_dim=64,
        intermediate_size=64, vocab_size=1024,
    )  # fmt: skip


class Server:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on a Unix
    socket, in a process group of its own (stopped with it)."""

    def __init__(self, name: str, model: Path, kv_transfer_config: dict[str, Any], workdir: Path) -> None:
        self.name = name
        self.socket = workdir / f"{name}.sock"
        self.log_path = workdir / f"{name}.log"
        spec = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS}},
        }
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--skip-tokenizer-init", "--dtype", "bfloat16", "--load-format", "dummy",
            "--max-model-len", str(TOKENS + 256), "--enforce-eager", "--block-size", str(BLOCK),
            "--kv-cache-memory-bytes", str(SERVER_KV_BYTES),
            "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv_transfer_config),
            "--uds", str(self.socket),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        with self.log_path.open("wb") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
            )
        self.t0 = time.monotonic()

    def healthy(self) -> bool:
        from kv_connector.datagen.httpclient import Server as Http

        if self.proc.poll() is not None:
            raise RuntimeError(f"server {self.name} exited ({self.proc.returncode}):\n{self.tail()}")
        return self.socket.exists() and Http(f"unix:{self.socket}").healthy()

    def metrics_text(self) -> str:
        """vLLM's /metrics, as text."""
        from kv_connector.datagen.httpclient import Server as Http

        return str(Http(f"unix:{self.socket}").get_text("/metrics"))

    def metrics(self) -> dict[str, float]:
        """The request-time sums this profile reads from vLLM's /metrics."""
        out: dict[str, float] = {}
        for line in self.metrics_text().splitlines():
            name = line.split("{", 1)[0]
            if name in SERVER_METRICS:
                out[SERVER_METRICS[name]] = out.get(SERVER_METRICS[name], 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its engine and workers, if any are left
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the group is empty (its children reaped)
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        log(f"server {self.name}: processes of its group {self.proc.pid} still there after 30 s")


def wait_healthy(servers: list[Server], deadline_s: float = SERVER_START_S) -> None:
    pending = list(servers)
    t0 = time.monotonic()
    while pending:
        pending = [s for s in pending if not s.healthy()]
        for s in servers:
            if s not in pending and not getattr(s, "_said", False):
                s._said = True  # type: ignore[attr-defined]
                log(f"server {s.name} healthy after {time.monotonic() - s.t0:.0f} s")
        if pending and time.monotonic() - t0 > deadline_s:
            raise TimeoutError(f"servers {[s.name for s in pending]} not healthy in {deadline_s} s")
        if pending:
            time.sleep(0.5)


class Loader:
    """speculators' DataLoader in a process of its own (``loader_main``), one epoch of the
    train split per ``round()``."""

    def __init__(
        self,
        backend: str,
        data: Path,
        server: Server,
        hs_dir: Path | None,
        rows: int,
        workers: int = WORKERS,
        fetch_agent: str = "rank",
        pool_mib: int | None = None,
    ) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(UDS_SITE), str(REPO), str(SPECULATORS_SITE)]),
            "KV_TEST_OPENAI_UDS": str(server.socket),
        }
        args = [str(data), backend, str(hs_dir or ""), str(rows), str(workers), fetch_agent]
        args.append(str(pool_mib or 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.bench_pull", "loader", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=REPO, text=True,
        )  # fmt: skip
        self.backend, self.server = backend, server
        self.name = backend if backend != "kv-hidden-states" else f"pull ({fetch_agent})"
        self.profile: list[dict[str, float]] = []

    def _ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} loader died ({self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def ready(self) -> None:
        self._ask("ready")

    def spawn(self) -> None:
        """Start the DataLoader's workers (answered by ``spawned``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("spawn\n")
        self.proc.stdin.flush()

    def spawned(self) -> None:
        assert self.proc.stdout is not None
        if not self.proc.stdout.readline():
            raise RuntimeError(f"the {self.backend} loader died ({self.proc.wait()})")

    def consumers(self) -> dict[str, Any]:
        """What fetches for this loader (one trainer rank): the processes under it that
        made a NIXL agent, and the consumer agents the producer says it served for it
        (named by the pid that made them, ``kv_connector.speculators.agent_name``) with the
        pool each registered."""
        tree = self._ask("count")
        pids = {tree["pid"], *tree["descendants"]}
        served: dict[str, int] = {}
        for line in self.server.log_path.read_text(errors="replace").splitlines():
            m = SERVED.search(line)
            if m and int(m.group(2)) in pids:
                served[m.group(1)] = int(m.group(3))
        return {
            "nixl_agent_processes": len(tree["nixl_agent_pids"]),
            "consumer_agents": len(served),
            "registered_mib": sum(served.values()),
            "workers": len(tree["workers"]),
            "memory_mib": tree["pss_mib"],  # the rank's processes' proportional set size
        }

    def round(self) -> paired.Run:
        before = self.server.metrics()
        r = self._ask("round")
        after = self.server.metrics()
        if r["errors"] or r["rows"] != r["expected"]:
            raise RuntimeError(f"{self.name}: a round gave {r}")
        prof = {k: v - before.get(k, 0.0) for k, v in after.items()}
        prof.update({f"workers_{k}_s": v for k, v in r["workers_s"].items()})
        prof["round_s"] = r["seconds"]
        self.profile.append(prof)
        log(f"{self.name}: {r['rows']} rows in {r['seconds']:.1f} s")
        return paired.Run(r["seconds"], r["rows"], r["bytes"], r["cpu_s"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self._ask("quit")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def loader_main(
    data: Path, backend: str, hs_dir: str, rows: int, workers: int, fetch_agent: str, pool_mib: int
) -> int:
    """The DataLoader process (PYTHONPATH holds speculators): writes a dataset of ``rows``
    train rows (plus one val row) and answers "ready", "spawn", "round", "count" and
    "quit" on stdin, with ``workers`` DataLoader workers (the pull backend's
    ``--kv-hs-fetch-agent fetch_agent``)."""
    import argparse

    import torch
    from datasets import Dataset
    from hs_connectors.transfer import HiddenStatesBackend
    from speculators.train.dataloader import create_train_val_loaders

    import kv_connector.speculators  # noqa: F401  registers kv-hidden-states

    rng = random.Random(11)
    ids = [[rng.randrange(1024) for _ in range(ROW_TOKENS)] for _ in range(rows + 1)]
    masks = [[1] * ROW_TOKENS for _ in ids]
    ds = Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "seq_len": [ROW_TOKENS] * len(ids)})
    ds.set_format(type="torch")
    ds.save_to_disk(str(data))
    manifest_only = backend == NULL_ARM  # the pull backend less its data (the ceiling arm)
    b = HiddenStatesBackend.registry["kv-hidden-states" if manifest_only else backend]
    parser = argparse.ArgumentParser()
    b.add_train_args(parser)
    argv = ["--hidden-states-path", hs_dir] if backend == "file" else ["--kv-hs-fetch-agent", fetch_agent]
    if pool_mib and backend != "file":
        argv += ["--kv-hs-pool-mib", str(pool_mib)]
    from scripts.bench_pull_transfer import ManifestOnly, TimedTransfer, read_log

    timings = data.parent / f"{data.name}-timings.txt"
    inner = b.from_train_args(parser.parse_args(argv), str(data))
    transfer = TimedTransfer(ManifestOnly() if manifest_only else inner, timings)
    train, _val = create_train_val_loaders(
        data_path=str(data), total_seq_len=ROW_TOKENS, hidden_states_dtype=torch.bfloat16,
        transfer=transfer, vllm_endpoint="http://localhost/v1", on_missing="generate",
        verifier_name_or_path=None, request_timeout=120.0, max_retries=2,
        generation_validation_retries=2, max_consecutive_generation_failures=5,
        hidden_size=HIDDEN, num_target_layers=len(LAYER_IDS) - 1, num_workers=workers, prefetch_factor=2,
        preprocess=None, train_data_ratio=(rows + 0.5) / (rows + 1),
    )  # fmt: skip
    row_bytes = ROW_TOKENS * len(LAYER_IDS) * HIDDEN * 2
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            print(json.dumps({"bye": True}), flush=True)
            break
        if cmd == "ready":
            print(json.dumps({"ready": True}), flush=True)
            continue
        if cmd == "count":  # the processes under this one, and which made a NIXL agent
            under = descendants(os.getpid())
            agents = [p for p in [os.getpid(), *under] if made_a_nixl_agent(p)]
            tree = {
                "pid": os.getpid(),
                "descendants": under,
                "nixl_agent_pids": agents,
                "workers": spawned_workers(under),
                "pss_mib": round(sum(pss_mib(p) for p in [os.getpid(), *under])),
            }
            print(json.dumps(tree), flush=True)
            continue
        if cmd == "spawn":  # start the (persistent) workers: one batch, the epoch left
            next(iter(train))
            print(json.dumps({"spawned": True}), flush=True)
            continue
        got = errors = 0
        read_log(timings)
        c0, t0 = paired.cpu_seconds(), time.perf_counter()
        for batch in train:
            errors += int(batch["error_records"])
            got += int(batch["document_ids"][0].max()) + 1 if batch["input_ids"].numel() else 0
        secs = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "seconds": secs,
                    "rows": got,
                    "expected": rows,
                    "errors": errors,
                    "bytes": float(got * row_bytes),
                    "cpu_s": paired.cpu_seconds() - c0,  # this process only (not its workers)
                    "workers_s": read_log(timings),  # summed over the workers
                }
            ),
            flush=True,
        )
    return 0


def server_configs(work: Path) -> dict[str, dict[str, Any]]:
    """Each server's --kv-transfer-config: ours in pull delivery, and the file backend's
    (vLLM's example connector made CPU-safe, writing to ``work/example-out``)."""
    return {
        "pull": {
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"delivery": "pull"},
        },
        "file": {
            "kv_connector": "CpuExampleHiddenStatesConnector",
            "kv_connector_module_path": "scripts.cpu_example_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(work / "example-out")},
        },
    }


@contextlib.contextmanager
def servers(work: Path, *names: str) -> Iterator[tuple[Server, ...]]:
    """The servers named (default both, "pull" and "file"), started together and healthy;
    stopped on exit."""
    model = work / "tiny-compute-llama"
    if not model.exists():
        tiny_compute_model(model)
    configs = server_configs(work)
    started: list[Server] = []
    try:
        for name in names or ("pull", "file"):
            started.append(Server(name, model, configs[name], work))
        wait_healthy(started)
        yield tuple(started)
    finally:
        for s in started:
            s.stop()


@contextlib.contextmanager
def loaders(*made: Loader) -> Iterator[tuple[Loader, ...]]:
    """Loaders with their workers started (all at once: the workers' start-up is most of
    a first round); stopped on exit."""
    try:
        for ld in made:
            ld.ready()
        t0 = time.monotonic()
        for ld in made:
            ld.spawn()
        for ld in made:
            ld.spawned()
        names = ', '.join(ld.name for ld in made)
        log(f"{names}: DataLoader workers started in {time.monotonic() - t0:.0f} s")
        yield made
    finally:
        for ld in made:
            ld.stop()


def bench_loader(pairs: int = LOADER_PAIRS, warmup: int = WARMUP, rows: int = ROWS) -> dict[str, Any]:
    """Three pairings, each with only its two loaders alive (12 workers each): our pull
    backend with the rank's fetch agent over the same with a client per worker (and what
    each runs: NIXL agents, the pools the producer served); over the file backend; and
    the manifest-only ceiling over the file backend."""
    work = Path(tempfile.mkdtemp(prefix="hs-bench-pull-"))
    (work / "hs-cache").mkdir()  # the file backend's cache directory: empty, every row generated
    try:
        with servers(work, "pull") as (pull_server,):
            log(f"DataLoader rounds of {rows} rows of {ROW_TOKENS} tokens, {WORKERS} workers per loader")

            def pull_loader(mode: str, pool_mib: int | None = None) -> Loader:
                data = work / f"data-{mode}"
                return Loader(
                    "kv-hidden-states", data, pull_server, None, rows, fetch_agent=mode, pool_mib=pool_mib
                )

            with loaders(pull_loader("rank"), pull_loader("worker", WORKER_POOL_MIB)) as (rank, worker):
                a = paired.run_pairs(rank.round, worker.round, pairs=pairs, warmup=warmup)
                log(f"rank agent over per-worker clients: {[round(x, 3) for x in a.ratio().values]}")
                counts = {"rank": rank.consumers(), "worker": worker.consumers()}
                log(f"what fetches for one rank: {counts}")
                worker.stop()  # two loaders of 12 workers and two servers do not fit 23 GiB: one at a time
                with servers(work, "file") as (file_server,):
                    file_loader = Loader("file", work / "data-file", file_server, work / "hs-cache", rows)
                    with loaders(file_loader):
                        p = paired.run_pairs(rank.round, file_loader.round, pairs=pairs, warmup=warmup)
                        log(f"profile: pull {rank.profile[-1]}, file {file_loader.profile[-1]}")
                        rank.stop()  # the ceiling: the pull backend with nothing read, over the file backend
                        null_loader = Loader(NULL_ARM, work / "data-null", pull_server, None, rows)
                        with loaders(null_loader) as (null,):
                            c = paired.run_pairs(null.round, file_loader.round, pairs=pairs, warmup=warmup)
                            log(f"manifest-only over file: {[round(x, 3) for x in c.ratio().values]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med, rng = p.ratio().rounded()
    ceiling, ceiling_rng = c.ratio().rounded()
    agent_ratio, agent_rng = a.ratio().rounded()

    def per_row(ld: Loader, first: int = warmup) -> dict[str, Any]:
        """Where a row's time goes (medians over the counted rounds of the first pairing
        it is in, seconds per row): the server's request time (queue + prefill, from its
        /metrics) and the workers' get_generated and delete (summed over the workers),
        beside the round's wall time per row."""
        rounds = ld.profile[first : first + pairs]
        return {k: round(statistics.median(r.get(k, 0.0) for r in rounds) / rows, 4) for k in rounds[0]}

    return {
        "pull_over_file": med,
        "range": rng,
        "manifest_only_over_file": ceiling,
        "manifest_only_range": ceiling_rng,
        "rank_agent_over_worker_clients": agent_ratio,
        "rank_agent_range": agent_rng,
        "per_rank": counts,
        "workers": WORKERS,
        "rank_rows_per_s": _spread([r.rate for r in a.a]),
        "worker_rows_per_s": _spread([r.rate for r in a.b]),
        "pull_rows_per_s": _spread([r.rate for r in p.a]),
        "file_rows_per_s": _spread([r.rate for r in p.b]),
        "pull_GB_per_s": _spread([r.gb_per_s for r in p.a]),
        "file_GB_per_s": _spread([r.gb_per_s for r in p.b]),
        "rows_per_round": rows,
        # the pull loader's rounds over the file backend follow its pairing with the worker clients
        "profile_s_per_row": {"pull": per_row(rank, 2 * warmup + pairs), "file": per_row(file_loader)},
        "file_output_dir": f"{work}/example-out (local disk, {tempfile.gettempdir()})",
    }


def main() -> dict[str, Any]:
    t0 = time.monotonic()
    out: dict[str, Any] = {"machine_start": paired.machine_state()}
    out["read"] = bench_read()
    log(f"pull_read_over_raw {out['read']['pull_read_over_raw']} in {time.monotonic() - t0:.0f} s")
    # the same with the integrity checks off at both ends (no XXH3, no values check): what
    # the protocol itself costs over the raw READ (diagnostic; fewer pairs)
    out["read_unchecked"] = bench_read(pairs=3, checks=False)
    log(f"unchecked: {out['read_unchecked']['pull_read_over_raw']} in {time.monotonic() - t0:.0f} s")
    out["loader"] = bench_loader()
    log(f"pull_over_file {out['loader']['pull_over_file']} in {time.monotonic() - t0:.0f} s")
    out["pull_read_over_raw"] = out["read"]["pull_read_over_raw"]
    out["pull_over_file"] = out["loader"]["pull_over_file"]
    out["machine_end"] = paired.machine_state()
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def _exit_on_term(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # the finally blocks stop every process started


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, _exit_on_term)
    if len(sys.argv) > 1 and sys.argv[1] == "loader":
        a = sys.argv
        sys.exit(loader_main(Path(a[2]), a[3], a[4], int(a[5]), int(a[6]), a[7], int(a[8])))
    if sys.argv[1:] in (["--loader"], ["--read"]):  # one part only: the DataLoader pairings, or the READs
        start = paired.machine_state()
        part = bench_loader() if sys.argv[1] == "--loader" else bench_read()
        print(json.dumps({**part, "machine_start": start, "machine_end": paired.machine_state()}))
        sys.exit(0)
    print(json.dumps(main()), flush=True)
