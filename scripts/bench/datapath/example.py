"""b: vLLM's ExampleHiddenStatesConnector driven as e is (``drive``), writing safetensors
files to /dev/shm (a minimal CPU-safe subclass: the stock one needs CUDA)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from scripts.bench.datapath.drive import drive, harness_rank
from scripts.bench.datapath.shape import TOKEN_BYTES
from scripts.bench.paired import cpu_seconds


def _cpu_example_connector() -> type:
    """vLLM's ExampleHiddenStatesConnector made CPU-safe (``scripts.support.cpu_example_connector``)."""
    from scripts.support.cpu_example_connector import CpuExampleHiddenStatesConnector

    return CpuExampleHiddenStatesConnector


class ExampleArm:
    """b: vLLM's ExampleHiddenStatesConnector (made CPU-safe) into files on /dev/shm."""

    def __init__(self, model_dir: Path, n_req: int, tokens: int, num_blocks: int) -> None:
        self.n_req, self.tokens = n_req, tokens
        self.out_dir = Path(tempfile.mkdtemp(prefix="hs-example-", dir="/dev/shm"))
        cls = _cpu_example_connector()
        ktc = {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(self.out_dir)},
        }
        self._vllm_worker, self.rank = harness_rank(model_dir, cls, ktc, num_blocks)
        self.rounds = 0
        self._write(1, "warmup")

    def _write(self, n: int, prefix: str) -> float:
        c0 = cpu_seconds()
        t0 = drive(self.rank, n, self.tokens, prefix=prefix)
        for fut in list(self.rank.worker._req_futures.values()):
            fut.result()
        seconds = time.time() - t0
        files = [f for f in self.out_dir.rglob("*.safetensors")]
        assert len(files) == n, (len(files), n)
        for f in files:
            f.unlink()
        self.cpu_s = cpu_seconds() - c0
        return seconds

    def round(self) -> dict[str, float]:
        self.rounds += 1
        seconds = self._write(self.n_req, f"r{self.rounds}-")
        return {
            "seconds": seconds, "units": float(self.n_req * self.tokens),
            "nbytes": float(self.n_req * self.tokens * TOKEN_BYTES), "cpu_s": self.cpu_s,
        }  # fmt: skip

    def close(self) -> dict[str, float]:
        self.rank.worker._executor.shutdown(wait=True)
        shutil.rmtree(self.out_dir, ignore_errors=True)
        return {}
