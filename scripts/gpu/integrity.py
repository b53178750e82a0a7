"""What only a GPU can show about block digests (``kv_connector.wire.block_digest``); run it on
a machine with CUDA: ``python -m scripts.gpu_block_digest``. CI runs the same torch code
on CPU tensors (tests/unit/wire/test_block_digest.py, tests/integration/test_integrity.py).

1. Bit for bit: the digests a rank computes from a cache in GPU memory, on its hashing
   thread's own stream, equal the reader's recomputation on CPU from the same bytes,
   for both layouts and bf16/fp32, with partly filled last blocks.
2. Only the digests cross PCIe: the device-to-host traffic is 8 bytes per block.
3. Cost: per 64 MiB share, the block digests on the GPU (side stream) beside staging the
   share to host memory and XXH3-64 over it (the ``"xxh3"`` path), and the reader's CPU
   recomputation beside its XXH3 check.

Prints one JSON line at the end.
"""

from __future__ import annotations

import json
import threading
import time

import torch

from kv_connector.reader.lease import sample_view
from kv_connector.sender.hasher import share_block_digest, share_checksum
from kv_connector.sender.jobs import Job
from kv_connector.wire import protocol
from kv_connector.wire.block_digest import cache_block_digests, sample_block_digests, share_digest
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


def _landed_run(raw_cpu: torch.Tensor, job: Job) -> torch.Tensor:
    g, nb = job.manifest.geometry, job.manifest.num_blocks
    run = torch.zeros(g.sample_bytes(nb), dtype=torch.uint8)
    for j in range(nb):
        for src, dst, n in g.arranged_spans(nb, j):
            at = job.block_ids[j] * g.block_bytes + src
            run[dst : dst + n] = raw_cpu[at : at + n]
    return run


def agreement() -> int:
    cases = 0
    for layout in ("LTH", "TLH"):
        for dtype in ("bfloat16", "float32"):
            for tokens in (1, 15, 16, 17, 1000):
                job = _case(layout, dtype, 16, 4, 512, tokens, 80)
                g = job.manifest.geometry
                raw = torch.randint(0, 256, (80 * g.block_bytes,), dtype=torch.uint8, device="cuda")
                got: list[int] = []
                t = threading.Thread(target=lambda: got.append(share_block_digest(raw, job)))  # noqa: B023
                t.start()
                t.join()
                run = _landed_run(raw.cpu(), job)
                m, share = job.manifest, list(job.share)
                want = share_digest(m, share, sample_block_digests(sample_view(run, m), m, share))
                assert got == [want], (layout, dtype, tokens)
                cases += 1
    return cases


def cost() -> dict[str, float]:
    job = _case("TLH", "bfloat16", 16, 4, 4096, 2048, 160)  # 64 MiB share
    g = job.manifest.geometry
    raw = torch.randint(0, 256, (160 * g.block_bytes,), dtype=torch.uint8, device="cuda")
    cache = raw.view(torch.bfloat16).view(-1, *g.block_shape())

    def timed(fn: object, n: int = 5) -> float:
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    out = {
        "share_MiB": job.manifest.num_blocks * g.block_bytes / (1 << 20),
        "gpu_block_digests_ms": timed(
            lambda: cache_block_digests(cache, job.manifest, job.block_ids, job.share)
        ),
        "stage_and_xxh3_ms": timed(lambda: share_checksum(raw, job, stage=True)),
    }
    run = _landed_run(raw.cpu(), job)
    states = sample_view(run, job.manifest)
    t0 = time.perf_counter()
    sample_block_digests(states, job.manifest, job.share)
    out["reader_cpu_block_digests_ms"] = (time.perf_counter() - t0) * 1e3
    from kv_connector.wire.integrity import sample_checksum

    t0 = time.perf_counter()
    sample_checksum(run.numpy().data, 0, job.manifest, job.share)
    out["reader_cpu_xxh3_ms"] = (time.perf_counter() - t0) * 1e3
    out["d2h_bytes_per_block"] = 8.0
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU (CUDA); CI runs the same code on CPU tensors")
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "cases_bit_exact": agreement()}
    result.update(cost())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
