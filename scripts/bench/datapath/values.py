"""What the reader's optional values check (``reader.pool.values``: NaN/Inf, all-zero tokens)
costs per sample of e's shape, beside the XXH3 checksum's pass over the same bytes."""

from __future__ import annotations

import time
from typing import Any

import torch

from scripts.bench.datapath.shape import HIDDEN, LAYERS


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
