"""The pull producer process of the integration tests (``pull_servers_main.py``: samples held
in one ``PullServer`` per rank, on a deterministic cache) and the samples planned on it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from typing import Any

from kv_connector.wire.layout import BlockLayout
from tests.integration.common import REPO, child_env, layout_dict

LAYER_IDS = [1, 2, 4]
NUM_CACHE_BLOCKS = 48
SEED = 7


class Producer:
    """The producer process: ``handles`` of its samples; ``poll()`` runs an engine step."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str | None] | None = None) -> None:
        self.spec = spec
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "integration" / "pull_servers_main.py"), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(env),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"producer died: {err[-3000:]}")
        first = json.loads(line)
        self.handles: dict[str, str] = first["handles"]
        self.endpoints: list[str] = first["endpoints"]

    def poll(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("poll\n")
        self.proc.stdin.flush()
        result: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return result

    def settled(self, held: list[int], within_s: float = 10.0) -> dict[str, Any]:
        """Poll until each rank holds ``held`` samples (or ``within_s`` passes); the last
        poll. A fenced release gets no answer: its rank takes it when it comes."""
        deadline = time.monotonic() + within_s
        while (polled := self.poll())["held"] != held and time.monotonic() < deadline:
            time.sleep(0.01)
        return polled

    def fault(self, request_id: str, kind: str) -> None:
        """One fault of docs/reliability.md on the sample's blocks (pull_servers_main.py)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"fault {request_id} {kind}\n")
        self.proc.stdin.flush()
        assert json.loads(self.proc.stdout.readline()) == "faulted"

    def end(self, request_id: str, how: str) -> None:
        """The sample's hold ends right after each rank answers its next fetch (``how``:
        "released" or "reassigned"), while the consumer READs."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"end {request_id} {how}\n")
        self.proc.stdin.flush()
        assert json.loads(self.proc.stdout.readline()) == "ending"

    def garble(self, request_id: str) -> None:
        """Change the first state of the sample's first block in the producer's cache."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"garble {request_id}\n")
        self.proc.stdin.flush()
        assert json.loads(self.proc.stdout.readline()) == "garbled"

    def stop(self) -> str:
        if self.proc.poll() is None:
            try:
                _, err = self.proc.communicate("quit\n", timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                _, err = self.proc.communicate()
            return err
        return ""


def samples_spec(n: int, layout: BlockLayout, seed: int = 3) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = rng.choice(
            [1, layout.block_size - 1, layout.block_size, layout.block_size + 1, 3 * layout.block_size + 5]
        )
        nb = layout.blocks_for(tokens)
        out.append(
            {
                "request_id": f"req-{i}",
                "num_tokens": tokens,
                "block_ids": rng.sample(range(NUM_CACHE_BLOCKS), nb),
            }
        )
    return out


def spec_of(layout: BlockLayout, samples: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return dict(
        layout=layout_dict(layout), num_cache_blocks=NUM_CACHE_BLOCKS, seed=SEED, layer_ids=LAYER_IDS,
        samples=samples, **extra,
    )  # fmt: skip


LTH = BlockLayout("LTH", 16, 3, 32, "float32")
TLH = BlockLayout("TLH", 16, 3, 32, "bfloat16")
