"""vLLM's OpenAI-compatible server (the CPU build) in a subprocess: the one launcher of the
benchmark (``scripts.bench.pull``, ``scripts.bench.datagen``) and the e2e tests
(``tests/e2e/api_server.py``).

It listens on a Unix socket (vLLM's ``--uds``), so no TCP port is picked and released
before the server binds it; requests go through ``kv_connector.datagen.httpclient``. The
CPU build's ``vllm`` console script dies at start (PackageNotFoundError), so the module
``vllm.entrypoints.openai.api_server`` is run directly: it takes ``vllm serve``'s flags.
The server logs to a file (it logs a lot, and a pipe nobody reads would block it), whose
tail every failure quotes. It runs in a process group of its own: ``stop()`` ends the
server and whatever it started (engine core, workers), and returns once the group is empty;
if the process that started it dies first, the kernel sends it SIGTERM
(``scripts.support.stopping``).

    with VllmServer(model, connector_config({"delivery": "pull"}), [1, 2], workdir) as server:
        server.http.post_json("/v1/completions", {...})
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from kv_connector.datagen.httpclient import Server as Http
from scripts.support.deaths import explain, program_env
from scripts.support.stopping import ends_with_parent

REPO = Path(__file__).resolve().parents[2]
STARTUP_DEADLINE_S = 420.0


class ServerFailed(RuntimeError):
    """The server exited, or was not healthy in time; the message ends with its log's tail."""


def tail(path: Path, n: int = 6000, returncode: int | None = None) -> str:
    """The last ``n`` characters of a log ("" if it cannot be read), then how any of
    vLLM's processes died (the server's own ``returncode`` too, where given)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    why = explain(text, returncode, "server")
    return text[-n:] + (f"\n{why}" if why else "")


def speculative_config(layer_ids: Sequence[int]) -> dict[str, Any]:
    """vLLM's ``extract_hidden_states`` method capturing ``layer_ids``."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def connector_config(extra_config: dict[str, Any]) -> dict[str, Any]:
    """``--kv-transfer-config`` for this project's HiddenStatesConnector as the producer."""
    return {
        "kv_connector": "HiddenStatesConnector",
        "kv_connector_module_path": "kv_connector.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra_config,
    }


class VllmServer:
    """One server: ``start()`` then ``wait_healthy()`` (or ``with VllmServer(...) as s:``,
    which does both and stops it on exit); ``http`` talks to it, ``log`` is its output.

    ``name`` names its socket and log in ``workdir`` (``NAME.sock``, ``NAME.log``); ``args``
    are more ``vllm serve`` flags; ``env`` is added to this process's environment (with
    ``OMP_NUM_THREADS=1`` and the repository on ``PYTHONPATH``)."""

    # called with each server as it starts (the tests count their engines with it)
    on_start: ClassVar[list[Callable[[VllmServer], None]]] = []

    def __init__(
        self,
        model: Path,
        kv_transfer_config: dict[str, Any],
        layer_ids: Sequence[int],
        workdir: Path,
        *,
        name: str = "api",
        dtype: str = "float32",
        max_model_len: int = 2048,
        kv_cache_bytes: int = 128 << 20,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.name = name
        self.socket_path = workdir / f"{name}.sock"
        self.log = workdir / f"{name}.log"
        self.http = Http(f"unix:{self.socket_path}")
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--skip-tokenizer-init", "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--enforce-eager",
            "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--speculative-config", json.dumps(speculative_config(layer_ids)),
            "--kv-transfer-config", json.dumps(kv_transfer_config),
            "--uds", str(self.socket_path), *args,
        ]  # fmt: skip
        self.env = program_env(env)
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.t0 = 0.0

    def start(self) -> VllmServer:
        for hook in VllmServer.on_start:
            hook(self)
        with self.log.open("wb") as f:  # a file, not a pipe: the server logs a lot and must not block
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
                start_new_session=True,
                preexec_fn=ends_with_parent(),  # not left behind if whoever started it dies
            )
        self.t0 = time.monotonic()
        return self

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def healthy(self) -> bool:
        """Whether it answers /health now; ``ServerFailed`` if it exited."""
        assert self.proc is not None, "start() first"
        if self.proc.poll() is not None:
            raise ServerFailed(f"server {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        return self.socket_path.exists() and self.http.healthy()

    def wait_healthy(self, deadline_s: float = STARTUP_DEADLINE_S) -> float:
        """Poll until healthy: the seconds since ``start()``; ``ServerFailed`` if it exits
        or is not healthy within ``deadline_s``."""
        while not self.healthy():
            if time.monotonic() > self.t0 + deadline_s:
                raise ServerFailed(f"server {self.name} not healthy within {deadline_s} s:\n{self.tail()}")
            time.sleep(1.0)
        return time.monotonic() - self.t0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics_text(self) -> str:
        """vLLM's /metrics, as text."""
        return str(self.http.get_text("/metrics"))

    def tail(self, n: int = 6000) -> str:
        return tail(self.log, n, self.proc.poll() if self.proc is not None else None)

    def stop(self) -> None:
        """SIGTERM, then (after ``stop_timeout_s``) SIGKILL to its whole process group; returns
        once the group is empty (or 30 s later). Idempotent."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.stop_timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its engine and workers, if any are left
        if proc.poll() is None:
            proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the group is empty (its children reaped)
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        left = f"server {self.name}: processes of its group {proc.pid} still there after 30 s"
        print(left, file=sys.stderr)


def wait_all_healthy(
    servers: Sequence[VllmServer], deadline_s: float, say: Callable[[str], None] = print
) -> None:
    """Servers started together, polled together until every one is healthy (``say``
    tells when each is); ``ServerFailed`` as ``wait_healthy``."""
    pending = list(servers)
    t0 = time.monotonic()
    while pending:
        for s in list(pending):
            if s.healthy():
                pending.remove(s)
                say(f"server {s.name} healthy after {time.monotonic() - s.t0:.0f} s")
        if pending and time.monotonic() - t0 > deadline_s:
            names = [s.name for s in pending]
            raise ServerFailed(f"servers {names} not healthy in {deadline_s} s:\n{pending[0].tail()}")
        if pending:
            time.sleep(0.5)
