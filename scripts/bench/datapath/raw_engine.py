"""ea: the ceiling of d inside vLLM's engine. The bench's raw connector
(``scripts.bench.raw_connector``) driven by the same harness rank and steps as e (real vLLM
objects, no model, the same cache of 4 samples): in the step that computed a prompt's last
token it WRITEs the prompt's blocks by NIXL into a raw target in another process
(``raw_target_proc``), and holds them until that target acknowledged the WRITE's
notification (on a pipe, answered at once). No protocol, credits, integrity record, slot
check, values screen or hand-out: what any connector pays on this machine that ships from
vLLM's engine and keeps a sample until its reader has it, the engine's own steps included."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import tempfile
import uuid
from pathlib import Path

from scripts.bench.datapath.drive import drive, harness_rank
from scripts.bench.datapath.raw import raw_target_proc
from scripts.bench.datapath.shape import BLOCK, HIDDEN, LAYERS
from scripts.bench.paired import cpu_seconds


class RawEngineArm:
    """ea: the raw connector, held until acknowledged, in e's harness rank."""

    def __init__(
        self, model_dir: Path, n_req: int, tokens: int, num_blocks: int, pool_bytes: int, hidden: int = HIDDEN
    ) -> None:
        from scripts.bench import raw_connector

        self.n_req, self.tokens = n_req, tokens
        self.sample_bytes = -(-tokens // BLOCK) * BLOCK * len(LAYERS) * hidden * 2
        ctx = mp.get_context("spawn")
        self.conn, b = ctx.Pipe()
        acks, acks_in = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=raw_target_proc, args=(b, pool_bytes, False, acks_in))
        self.proc.start()
        md, addr, nbytes = self.conn.recv()
        self._dir = Path(tempfile.mkdtemp(prefix="hs-raw-engine-"))
        target = self._dir / "target.json"
        target.write_text(json.dumps({"metadata": md.hex(), "addr": addr, "nbytes": nbytes}))
        self._acks_name = f"ea-{uuid.uuid4().hex[:8]}"
        raw_connector.ACKS[self._acks_name] = acks
        ktc = {
            "kv_connector": "RawShipConnector",
            "kv_connector_module_path": "scripts.bench.raw_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"raw_target": str(target), "acks": self._acks_name},
        }
        cls = raw_connector.RawShipConnector
        self._vllm_worker, self.rank = harness_rank(model_dir, cls, ktc, num_blocks)
        # the connector wrote its agent's metadata beside the target's (``raw_connector``)
        self.conn.send(bytes.fromhex(target.with_suffix(".producer").read_text()))
        self.rounds = 0
        self._take(1, "warmup")  # connection set-up and first touch out of the timing

    def _take(self, n: int, prefix: str) -> tuple[float, float, float, float]:
        self.conn.send(("expect", n, self.sample_bytes))
        c0 = cpu_seconds()
        t0 = drive(self.rank, n, self.tokens, prefix=prefix)  # every prompt acknowledged
        t_end, target_cpu = self.conn.recv()
        return t0, t_end, cpu_seconds() - c0, target_cpu

    def round(self) -> dict[str, float]:
        self.rounds += 1
        acked = self.rank.worker.acked
        t0, t_end, producer_cpu, target_cpu = self._take(self.n_req, f"r{self.rounds}-")
        return {
            "acks": float(self.rank.worker.acked - acked),
            "seconds": t_end - t0, "units": float(self.n_req * self.tokens),
            "nbytes": float(self.n_req * self.sample_bytes), "cpu_s": producer_cpu + target_cpu,
            "producer_cpu_s": producer_cpu, "reader_cpu_s": target_cpu,
        }  # fmt: skip

    def close(self) -> dict[str, float]:
        from scripts.bench import raw_connector

        self.rank.shutdown()
        self.conn.send(("stop",))
        self.proc.join(30)
        raw_connector.ACKS.pop(self._acks_name, None)
        shutil.rmtree(self._dir, ignore_errors=True)
        return {}
