"""Check a of the device tier: the producer's integrity record computed where the cache is.

Today's record for a GPU cache is the block digests (``kv_connector.wire.block_digest``),
which the sender's hashing thread computes on the cache's device, on a stream of its own
(``cache.blocks.share_block_digest``). This check shows:

1. Bit for bit: the digests computed from a cache on ``device`` equal the reader's
   recomputation on the host from the same bytes laid out as they land in its pool, for
   both cache layouts, bf16 and fp32, partly filled last blocks included.
2. Only the digests cross to the host: 8 bytes per block.
3. The cost per GB: the block digests on the device, staging the share to the host with
   XXH3-64 over it (the ``"xxh3"`` mode on a GPU cache), and the reader's two host
   recomputations.

On ``device="cpu"`` the same code runs on host tensors (CI runs it so; the figures then
say nothing about a GPU).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kv_connector.cache.blocks import share_block_digest, share_checksum
from kv_connector.reader.pool.lease import sample_view
from kv_connector.sender.jobs import Job
from kv_connector.wire import protocol
from kv_connector.wire.block_digest import cache_block_digests, checksum_of_digests, sample_block_digests
from kv_connector.wire.integrity import sample_checksum
from kv_connector.wire.layout import BlockLayout


def _case(layout: str, dtype: str, bs: int, layers: int, hidden: int, tokens: int, num_cache: int) -> Job:
    g = BlockLayout(layout, bs, layers, hidden, dtype)  # type: ignore[arg-type]
    nb = g.blocks_for(tokens)
    block_ids = torch.randperm(num_cache)[:nb].tolist()
    m = protocol.Manifest(
        request_id="r",
        token_ids=list(range(tokens)),
        layer_ids=list(range(layers)),
        geometry=g,
        num_blocks=nb,
    )
    return Job("r", m, block_ids, share=range(nb), t_submit=0.0)


def _landed_run(raw_host: torch.Tensor, job: Job) -> torch.Tensor:
    """The share's bytes as the reader's pool holds them once landed."""
    g, nb = job.manifest.geometry, job.manifest.num_blocks
    run = torch.zeros(g.sample_bytes(nb), dtype=torch.uint8)
    for j in range(nb):
        for src, dst, n in g.arranged_spans(nb, j):
            at = job.block_ids[j] * g.block_bytes + src
            run[dst : dst + n] = raw_host[at : at + n]
    return run


def agreement(device: torch.device) -> int:
    """Cases where the device's digests equal the host reference (AssertionError otherwise)."""
    cases = 0
    for layout in ("LTH", "TLH"):
        for dtype in ("bfloat16", "float32"):
            for tokens in (1, 15, 16, 17, 1000):
                job = _case(layout, dtype, 16, 4, 512, tokens, 80)
                g = job.manifest.geometry
                raw = torch.randint(0, 256, (80 * g.block_bytes,), dtype=torch.uint8, device=device)
                got: list[int] = []
                # on a thread of its own, as the sender's hasher computes it
                t = threading.Thread(target=lambda: got.append(share_block_digest(raw, job)))  # noqa: B023
                t.start()
                t.join()
                run = _landed_run(raw.cpu(), job)
                m, share = job.manifest, list(job.share)
                want = checksum_of_digests(m, share, sample_block_digests(sample_view(run, m), m, share))
                assert got == [want], (layout, dtype, tokens, got, want)
                cases += 1
    return cases


def _timed_ms(fn: Callable[[], Any], device: torch.device, n: int = 5) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e3


def cost(device: torch.device, share_mib: int = 64) -> dict[str, float]:
    """Milliseconds and GB/s per ``share_mib`` share (bf16, TLH as on a GPU)."""
    tokens = share_mib * 32  # 4 layers x 4096 x 2 bytes = 32 KiB a token
    num_cache = 2 * -(-tokens // 16) + 8
    job = _case("TLH", "bfloat16", 16, 4, 4096, tokens, num_cache)
    g = job.manifest.geometry
    raw = torch.randint(0, 256, (num_cache * g.block_bytes,), dtype=torch.uint8, device=device)
    cache = raw.view(torch.bfloat16).view(-1, *g.block_shape())
    nbytes = job.manifest.num_blocks * g.block_bytes
    out = {
        "share_MiB": nbytes / (1 << 20),
        "device_block_digests_ms": _timed_ms(
            lambda: cache_block_digests(cache, job.manifest, job.block_ids, job.share), device
        ),
        "stage_and_xxh3_ms": _timed_ms(lambda: share_checksum(raw, job, stage=True), device),
    }
    run = _landed_run(raw.cpu(), job)
    states = sample_view(run, job.manifest)
    cpu = torch.device("cpu")
    out["reader_host_block_digests_ms"] = _timed_ms(
        lambda: sample_block_digests(states, job.manifest, job.share), cpu, 2
    )
    out["reader_host_xxh3_ms"] = _timed_ms(
        lambda: sample_checksum(run.numpy().data, 0, job.manifest, job.share), cpu, 2
    )
    for key in [k for k in out if k.endswith("_ms")]:
        out[key.removesuffix("_ms") + "_GBps"] = nbytes / (out[key] / 1e3) / 1e9
    out["d2h_bytes_per_block"] = 8.0
    return out


def check(device: torch.device, share_mib: int = 64) -> dict[str, Any]:
    """Check a: agreement, then the cost."""
    return {"cases_bit_exact": agreement(device), **cost(device, share_mib)}
