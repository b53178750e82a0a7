"""The DataLoader pairings' two vLLM OpenAI servers (``scripts.support.vllm_server``):
ours in pull delivery and vLLM's ExampleHiddenStatesConnector made CPU-safe writing files,
on the same flags: a Llama of hidden 4096 whose compute is tiny, ``--load-format dummy``,
bf16, block 128."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scripts.bench.pull.shape import (
    BLOCK,
    HIDDEN,
    LAYER_IDS,
    SERVER_KV_BYTES,
    SERVER_METRICS,
    SERVER_START_S,
    TOKENS,
    log,
)
from scripts.support.vllm_server import VllmServer, connector_config, wait_all_healthy


class Server(VllmServer):
    """One of the two servers, on a Unix socket in ``workdir`` (``NAME.sock``, its log
    ``NAME.log``), in a process group of its own (stopped with it)."""

    def __init__(self, name: str, model: Path, kv_transfer_config: dict[str, Any], workdir: Path) -> None:
        super().__init__(
            model, kv_transfer_config, LAYER_IDS, workdir, name=name, dtype="bfloat16",
            max_model_len=TOKENS + 256, kv_cache_bytes=SERVER_KV_BYTES,
            args=["--load-format", "dummy", "--block-size", str(BLOCK)],
        )  # fmt: skip
        self.start()

    def metrics(self) -> dict[str, float]:
        """The request-time sums this profile reads from vLLM's /metrics."""
        out: dict[str, float] = {}
        for line in self.metrics_text().splitlines():
            name = line.split("{", 1)[0]
            if name in SERVER_METRICS:
                out[SERVER_METRICS[name]] = out.get(SERVER_METRICS[name], 0.0) + float(line.rsplit(" ", 1)[1])
        return out


def tiny_compute_model(out: Path, hidden: int = HIDDEN) -> Path:
    from scripts.support.vllm_harness import config_only_model

    return config_only_model(
        out, hidden, num_layers=4, num_attention_heads=1, num_key_value_heads=1, head_dim=64,
        intermediate_size=64, vocab_size=1024,
    )  # fmt: skip


def server_configs(work: Path) -> dict[str, dict[str, Any]]:
    """Each server's --kv-transfer-config: ours in pull delivery, and the file backend's
    (vLLM's example connector made CPU-safe, writing to ``work/example-out``)."""
    return {
        "pull": connector_config({"delivery": "pull"}),
        "file": {
            "kv_connector": "CpuExampleHiddenStatesConnector",
            "kv_connector_module_path": "scripts.support.cpu_example_connector",
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
        wait_all_healthy(started, SERVER_START_S, log)
        yield tuple(started)
    except BaseException:
        # a server that died mid-run (a refused connection, a 500): its log goes with the
        # run's temporary directory, so say what it said first
        for s in started:
            state = "running" if s.proc is not None and s.proc.poll() is None else "exited"
            log(f"server {s.name} ({state}), the end of its log:\n{s.tail(4000)}")
        raise
    finally:
        for s in started:
            s.stop()
