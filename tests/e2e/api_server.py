"""vLLM's OpenAI-compatible server (the CPU build) in a subprocess, for e2e tests.

It listens on a Unix socket (vLLM's ``--uds``), so no TCP port is picked and released
before the server binds it; requests go through ``kv_connector.datagen.httpclient``. The CPU
build's ``vllm`` console script dies at start (PackageNotFoundError), so the module
``vllm.entrypoints.openai.api_server`` is run directly: it takes ``vllm serve``'s flags.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kv_connector.datagen.httpclient import Server
from tests.e2e.conftest import REPO

STARTUP_DEADLINE_S = 420.0


def tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class ApiServer:
    """``with ApiServer(model, kv_connector_extra_config, layer_ids, tmp) as server:``
    starts the server and waits until it is healthy; ``server.http`` talks to it."""

    def __init__(
        self,
        model: Path,
        extra_config: dict[str, Any],
        layer_ids: Sequence[int],
        workdir: Path,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.socket_path = workdir / "api.sock"
        self.log = workdir / "server.log"
        self.http = Server(f"unix:{self.socket_path}")
        spec = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        }
        kv = {
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": extra_config,
        }
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--skip-tokenizer-init", "--dtype", "float32",
            "--max-model-len", "2048", "--enforce-eager", "--kv-cache-memory-bytes", str(128 << 20),
            "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            "--uds", str(self.socket_path), *args,
        ]  # fmt: skip
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ApiServer:
        with self.log.open("wb") as f:  # a file, not a pipe: the server logs a lot and must not block
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() < t0 + STARTUP_DEADLINE_S:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} during startup:\n{tail(self.log)}")
            if self.http.healthy():
                print(f"server healthy after {time.monotonic() - t0:.1f} s")
                return
            time.sleep(1.0)
        pytest.fail(f"server not healthy within {STARTUP_DEADLINE_S} s:\n{tail(self.log)}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
