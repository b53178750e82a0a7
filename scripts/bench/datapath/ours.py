"""e: our connector's worker side driven with real vLLM objects (``scripts.support.vllm_harness``,
no model) into a ``HiddenStatesReader`` in another process that takes every sample on lease
(``_reader_proc``): with the connector's default integrity record (fingerprints), XXH3
checksums or none, with the metrics on or off."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from scripts.bench.datapath.drive import drive, harness_rank
from scripts.bench.paired import cpu_seconds, memory_mib


def _reader_proc(conn: Any, pool_bytes: int, metrics: bool = True, checked: bool = True) -> None:
    """A trainer that takes every sample on lease and lets it go at the next one (what
    ``for sample in reader`` does with a sample the loop body does not keep); with
    ``metrics``, the reader serves its metrics and a scraper reads them every second
    (Prometheus' default is every 15 s). Unless ``checked``, it accepts shares without a
    checksum (the no-checksum arm; by default a reader refuses them from host caches).
    Takes ("take", n) commands: n samples, then (end time, bytes, CPU seconds spent)."""
    import threading

    base = memory_mib()  # python and torch, which a trainer's process holds anyway
    from kv_connector.datagen.httpclient import Server
    from kv_connector.reader import HiddenStatesReader

    with HiddenStatesReader(
        pool_bytes=pool_bytes,
        metrics_address="127.0.0.1:0" if metrics else None,
        require_checksum="auto" if checked else "never",
    ) as reader:
        conn.send(reader.address)
        stop = threading.Event()
        scrapes = [0]

        def scrape() -> None:
            http = Server(f"http://{reader.metrics_address}")
            while not stop.wait(1.0):
                http.get_text("/metrics")
                scrapes[0] += 1

        scraper = threading.Thread(target=scrape, daemon=True)
        if metrics:
            scraper.start()
        while (cmd := conn.recv())[0] == "take":
            c0 = cpu_seconds()
            nbytes = 0
            for s in reader.samples(cmd[1], timeout=300):
                nbytes += s.hidden_states.numel() * s.hidden_states.element_size()
                last = s
            last.let_go()
            conn.send((time.time(), nbytes, cpu_seconds() - c0))
        stop.set()
        stats = reader.stats().as_dict()
        stats["scrapes"] = scrapes[0]
        # VmHWM, not ru_maxrss: a spawned child's ru_maxrss starts at its parent's
        mem = memory_mib()
        stats["rss_mib"] = mem["peak"]
        stats["rss_beyond_torch_mib"] = mem["peak"] - (base["anon"] + base["file"] + base["shmem"])
        stats.update({f"rss_{k}_mib": v for k, v in mem.items() if k != "peak"})
        conn.send(stats)


class OursArm:
    """e: our connector's worker side (real vLLM objects, no model) into a reader process."""

    def __init__(
        self,
        model_dir: Path,
        n_req: int,
        tokens: int,
        num_blocks: int,
        pool_bytes: int,
        checksum: str = "auto",
        metrics: bool = True,
    ) -> None:
        from kv_connector.connector import HiddenStatesConnector

        self.n_req, self.tokens, self.pool_bytes = n_req, tokens, pool_bytes
        ctx = mp.get_context("spawn")
        self.conn, b = ctx.Pipe()
        self.proc = ctx.Process(target=_reader_proc, args=(b, pool_bytes, metrics, checksum != "none"))
        self.proc.start()
        address = self.conn.recv()
        ktc = {
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"consumer_address": address, "checksum": checksum},
        }
        cls = HiddenStatesConnector
        self._vllm_worker, self.rank = harness_rank(model_dir, cls, ktc, num_blocks, metrics)
        assert self.rank.worker.wait_connected(30)
        self.rounds = 0
        self._take(1, "warmup")  # connection set-up and first touch out of the timing

    def _take(self, n: int, prefix: str) -> tuple[float, float, float, float, float]:
        self.conn.send(("take", n))
        c0 = cpu_seconds()
        t0 = drive(self.rank, n, self.tokens, prefix=prefix)
        failed = self.rank.worker.recent_failures()
        if failed:  # the reader would wait for samples that never come
            self.proc.kill()
            raise RuntimeError(f"{len(failed)} requests failed, e.g. {next(iter(failed.items()))}")
        t_end, nbytes, reader_cpu = self.conn.recv()
        return t0, t_end, nbytes, cpu_seconds() - c0, reader_cpu

    def round(self) -> dict[str, float]:
        self.rounds += 1
        posted = self._post_s()
        t0, t_end, nbytes, producer_cpu, reader_cpu = self._take(self.n_req, f"r{self.rounds}-")
        return {
            "seconds": t_end - t0, "units": float(self.n_req * self.tokens), "nbytes": float(nbytes),
            "cpu_s": producer_cpu + reader_cpu, "producer_cpu_s": producer_cpu, "reader_cpu_s": reader_cpu,
            "post_s": self._post_s() - posted,
        }  # fmt: skip

    def _post_s(self) -> float:
        """The time the sender's writer spent inside WRITE posts so far (the copy, here)."""
        return float(sum(s.post_s for s in self.rank.worker.sender_stats()))

    def close(self) -> dict[str, float]:
        sender_stats = self.rank.worker.sender_stats()[0].as_dict()
        steps_with_stats = self.rank.steps_with_stats
        self.rank.shutdown()  # first, so that it does not try to reach the closed reader
        self.conn.send(("stop",))
        reader_stats = self.conn.recv()
        self.proc.join(30)
        return {
            "reader_copy_out_s": reader_stats["copy_s"],
            "reader_rss_mib": reader_stats["rss_mib"],
            **{f"reader_{k}": v for k, v in reader_stats.items() if k.startswith("rss_")},
            "reader_pool_mib": self.pool_bytes / (1 << 20),
            "reader_verify_s": reader_stats["verify_s"],
            "reader_scrapes": float(reader_stats["scrapes"]),
            "sender_write_s": sender_stats["write_s"],
            "sender_checksum_s": sender_stats["checksum_s"],
            "steps_with_stats": float(steps_with_stats),
        }
