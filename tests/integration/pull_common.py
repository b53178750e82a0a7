"""The pull producer process of the integration tests (``pull_servers_main.py``: samples held
in one ``PullServer`` per rank, on a deterministic cache) and the samples planned on it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
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
        self.spec, self.env = spec, env
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by stop) its log, however long it runs (a pipe fills)
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "integration" / "pull_servers_main.py"), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=child_env(env),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"producer died: {self.stop()[-3000:]}")
        first = json.loads(line)
        self.handles: dict[str, str] = first["handles"]
        self.endpoints: list[str] = first["endpoints"]

    def poll(self) -> dict[str, Any]:
        result: dict[str, Any] = self._ask("poll")
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
        assert self._ask(f"fault {request_id} {kind}") == "faulted"

    def end(self, request_id: str, how: str) -> None:
        """The sample's hold ends right after each rank answers its next fetch (``how``:
        "released" or "reassigned"), while the consumer READs."""
        assert self._ask(f"end {request_id} {how}") == "ending"

    def garble(self, request_id: str) -> None:
        """Change the first state of the sample's first block in the producer's cache."""
        assert self._ask(f"garble {request_id}") == "garbled"

    def hold(self, samples: list[dict[str, Any]]) -> dict[str, str]:
        """More samples held, as the first ones were; their handles (also in ``handles``)."""
        handles: dict[str, str] = self._ask(f"hold {json.dumps(samples)}")
        self.handles.update(handles)
        return handles

    def reset(self) -> list[int]:
        """Every hold ends, the cache is as it was made, what was freed is forgotten; how
        many each rank holds (all zeros: the process is as new)."""
        held: list[int] = self._ask("reset")
        self.handles.clear()
        return held

    def _ask(self, cmd: str) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"producer died answering {cmd.split()[0]!r}: {self.stop()[-3000:]}")
        return json.loads(line)

    def stop(self) -> str:
        """Stopped (killed if it does not quit within 30 s); its log."""
        if self.proc.poll() is None:
            try:
                self.proc.communicate("quit\n", timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
        if self._log.closed:
            return ""
        self._log.seek(0)
        log = self._log.read()
        self._log.close()
        return log


DEFAULTS: dict[str, Any] = {  # pull_servers_main.py's, so that saying one is the same configuration
    "world_size": 1, "producer_id": "producer", "timeout_s": 300.0, "checksum": "auto", "fences": True,
    "pad_bytes": 0,
}  # fmt: skip


class SharedProducers:
    """Producer processes shared by a module's tests, one per configuration (its spec but
    the samples, and its environment): ``lend`` holds a test's samples on the running one
    (or starts it), and after the test each is reset, as new for the next test; a failed
    test's are stopped, what it left in them unknown. A second producer of one
    configuration in one test is a process of its own, stopped after the test."""

    def __init__(self) -> None:
        self._running: dict[str, Producer] = {}
        self._lent: list[Producer] = []
        self._own: list[Producer] = []

    def lend(self, spec: dict[str, Any], env: dict[str, str | None] | None = None) -> Producer:
        config = DEFAULTS | {k: v for k, v in spec.items() if k != "samples"}
        key = json.dumps([config, env], sort_keys=True)
        p = self._running.get(key)
        if p is not None and p in self._lent:
            own = Producer(spec, env)
            self._own.append(own)
            return own
        if p is not None and p.proc.poll() is None:
            p.hold(spec["samples"])
        else:
            p = self._running[key] = Producer(spec, env)
        self._lent.append(p)
        return p

    def give_back(self, failed: bool) -> None:
        """After a test: its producers reset (or stopped, had it failed or one not reset)."""
        for p in self._own:
            p.stop()
        self._own.clear()
        for p in self._lent:
            world = p.spec.get("world_size", 1)
            if failed or p.proc.poll() is not None or p.reset() != [0] * world:
                p.stop()
                self._running = {k: q for k, q in self._running.items() if q is not p}
        self._lent.clear()

    def close(self) -> None:
        self.give_back(failed=True)
        for p in self._running.values():
            p.stop()
        self._running.clear()


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
