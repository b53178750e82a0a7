"""What the pull arms share: the captured shape (4 layers x hidden 4096, bf16, block 128),
each pairing's sizes and rounds, where speculators is installed, and the progress log."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench import paired

REPO = Path(__file__).resolve().parents[3]
# where scripts/setup_env.sh installs speculators (as tests/e2e/test_speculators.py finds it)
SPECULATORS_SITE = Path(os.environ.get("SPECULATORS_SITE") or Path(sys.prefix) / "speculators-site-packages")
UDS_SITE = REPO / "scripts" / "support" / "uds_site"  # openai clients over the server's Unix socket

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
    print(f"[bench.pull {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def spread(values: list[float]) -> dict[str, Any]:
    """``{"median": m, "range": [min, max]}``, rounded."""
    s = paired.Spread.of(values)
    med, rng = s.rounded()
    return {"median": med, "range": rng}


def sample_tokens(i: int, n: int) -> list[int]:
    return [(i * 131 + k * 7) % 1000 for k in range(n)]


def digest(data: Any) -> str:
    import xxhash

    return str(xxhash.xxh3_64_hexdigest(memoryview(data)))
