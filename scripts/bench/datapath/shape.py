"""The sizes every data-path arm shares: GPU-sized states (4 captured layers x hidden 4096,
bf16: 32 KiB per token) in vLLM's CPU blocks; and the benchmark's progress line."""

from __future__ import annotations

import sys
import time

LAYERS = [1, 2, 3, 4]
HIDDEN = 4096
BLOCK = 128  # vLLM's CPU block size
TOKEN_BYTES = len(LAYERS) * HIDDEN * 2


def say(text: str) -> None:
    print(f"[bench.datapath {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
