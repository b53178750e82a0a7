"""The producer's metrics on the real OpenAI server's ``/metrics`` (vLLM's own stats path,
beside vLLM's series, with its labels) and the reader's on its ``metrics_address``,
scraped while real requests ship, and checked against what was sent: counts exact, bytes
exact. The producer ships to two readers: one real, one that never comes up (a port held
and refusing), so requests sharded to it fail by name (``unreachable``) and the rest
arrive."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kv_connector.datagen.httpclient import Server
from kv_connector.reader import HiddenStatesReader, Sample
from kv_connector.reader.push.reader import ReaderClosed
from tests.e2e.api_server import ApiServer, tail
from tests.ports import address_of, held_port
from tests.promtext import excerpt, parse, scrape, value, wait_for_values

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYER_IDS = [1, 2, 4]
HIDDEN = 128
BLOCK = 128  # pinned in the server's configuration (--block-size)
BLOCK_BYTES = BLOCK * len(LAYER_IDS) * HIDDEN * 4  # float32
P = "vllm:hidden_states_"
R = "hidden_states_reader_"


@pytest.mark.fresh_engine("a server's metrics, counted from its start")
def test_the_servers_and_the_readers_metrics_count_what_was_shipped(tiny_llama: Path, tmp_path: Path) -> None:
    rng = random.Random(16)
    held = held_port()  # the second reader's address: never up, connections refused
    stop = threading.Event()
    got: dict[str, Sample] = {}

    def consume(reader: HiddenStatesReader) -> None:
        while not stop.is_set():
            try:
                s = reader.get(timeout=0.2, copy=True)
            except TimeoutError:
                continue
            except ReaderClosed:
                return
            assert s.request_id not in got
            got[s.request_id] = s

    with (
        held,
        HiddenStatesReader(metrics_address="127.0.0.1:0") as reader,
        ApiServer(
            tiny_llama,
            {"consumer_address": [reader.address, address_of(held)], "connect_timeout_s": 3},
            LAYER_IDS,
            tmp_path,
            args=["--block-size", str(BLOCK)],
            env={"VLLM_LOG_STATS_INTERVAL": "1"},  # vLLM's log line of our stats, every second
        ) as server,
    ):
        consumer = threading.Thread(target=consume, args=(reader,), daemon=True)
        consumer.start()
        labels = {"model_name": str(tiny_llama), "engine": "0"}
        _, before = scrape(server.http)
        assert value(before, P + "samples_shipped_total", **labels) == 0  # there from the start
        assert value(before, P + "samples_failed_total", reason="checksum", **labels) == 0
        assert value(before, "vllm:num_requests_running", **labels) is not None  # beside vLLM's

        def complete(prompt: list[int]) -> dict[str, Any]:
            return server.http.post_json(
                "/v1/completions",
                {"model": str(tiny_llama), "prompt": prompt, "max_tokens": 2, "temperature": 0},
            )

        # request ids are random: their reader (crc32 of the id) too. Ask until both kinds
        # came back (each batch has a 1 in 2**7 chance of landing on one reader only).
        responses: list[dict[str, Any]] = []
        prompts: list[list[int]] = []
        mid_flight: list[str] = []
        with ThreadPoolExecutor(8) as pool:
            for _ in range(3):
                batch = [[rng.randrange(1, 1024) for _ in range(rng.randint(1, 300))] for _ in range(8)]
                futures = [pool.submit(complete, p) for p in batch]
                mid_flight.append(server.http.get_text("/metrics"))  # while they run
                responses += [f.result() for f in futures]
                prompts += batch
                status = {r["kv_transfer_params"]["hidden_states"]["status"] for r in responses}
                if "failed" in status and status - {"failed"}:
                    break
        assert server.alive(), tail(server.log)
        params = [r["kv_transfer_params"]["hidden_states"] for r in responses]
        failed = [hs for hs in params if hs["status"] == "failed"]
        shipped = [(hs, p) for hs, p in zip(params, prompts, strict=True) if hs["status"] != "failed"]
        assert failed and shipped, params
        for hs in failed:
            assert f"cannot reach the reader at {address_of(held)}" in hs["error"], hs
        tokens = sum(len(p) for _, p in shipped)
        blocks = sum(-(-len(p) // BLOCK) for _, p in shipped)
        n = len(shipped)

        text, m = wait_for_values(
            server.http,
            [
                (P + "samples_shipped_total", labels, n),
                (P + "samples_delivered_total", labels, n),
                (P + "samples_failed_total", {"reason": "unreachable", **labels}, len(failed)),
                (P + "written_bytes_total", labels, blocks * BLOCK_BYTES),
                (P + "writes_total", labels, n),
                (P + "write_latency_seconds_count", labels, n),
                (P + "credit_wait_seconds_count", labels, n),
                (P + "rewrites_total", labels, 0),
                (P + "kv_blocks_held", labels, 0),
                (P + "samples_in_flight", labels, 0),
                (P + "requests_waiting_for_reader", labels, 0),
                (P + "readers_reachable", labels, 1),
            ],
            timeout=120,
        )
        for reason in ("refused", "checksum", "write_failed", "other"):
            assert value(m, P + "samples_failed_total", reason=reason, **labels) == 0
        for earlier in mid_flight:  # counters never run ahead of the final count
            assert (value(parse(earlier), P + "samples_shipped_total", **labels) or 0) <= n

        producer = shipped[0][0]["producer_id"]
        reader_http = Server(f"http://{reader.metrics_address}")
        rtext, _ = wait_for_values(
            reader_http,
            [
                (R + "samples_received_total", {"producer": producer}, n),
                (R + "tokens_received_total", {"producer": producer}, tokens),
                (R + "received_bytes_total", {"producer": producer}, tokens * len(LAYER_IDS) * HIDDEN * 4),
                (R + "handout_latency_seconds_count", {}, n),
                (R + "producers_connected", {}, 1),
                (R + "checksum_failures_total", {}, 0),
            ],
            timeout=30,
        )
        stop.set()
        consumer.join(timeout=10)
        logged = [
            ln for ln in server.log.read_text().splitlines() if "KV Transfer metrics: samples shipped=" in ln
        ]
        assert logged, tail(server.log)
        assert {hs["request_id"] for hs, _ in shipped} == set(got)
        report = (
            f"--- producer /metrics ({len(params)} requests: {n} shipped, {len(failed)} unreachable)\n"
            f"{excerpt(text, P)}\n--- reader {reader.metrics_address}/metrics\n{excerpt(rtext, R)}\n"
        )
        (tmp_path / "scrape.txt").write_text(report)
        print(report)


@pytest.mark.fresh_engine("a TP=2 server")
def test_tensor_parallel_ranks_are_merged_each_sample_counted_once(tiny_llama: Path, tmp_path: Path) -> None:
    """TP=2 (vLLM's own executor, two worker processes): the ranks' stats are merged by
    vLLM each step. Each sample counts once, its bytes are the two stripes' sum, every
    non-empty stripe is one WRITE, and every rank waited for its own grant."""
    rng = random.Random(17)
    prompts = [[rng.randrange(1, 1024) for _ in range(n)] for n in (1, BLOCK, BLOCK + 1, 300, 700)]
    got: list[str] = []
    with (
        HiddenStatesReader() as reader,
        ApiServer(
            tiny_llama,
            {"consumer_address": reader.address},
            LAYER_IDS,
            tmp_path,
            args=["--block-size", str(BLOCK), "--tensor-parallel-size", "2"],
            env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        ) as server,
        ThreadPoolExecutor(len(prompts)) as pool,
    ):
        futures = [
            pool.submit(
                server.http.post_json,
                "/v1/completions",
                {"model": str(tiny_llama), "prompt": p, "max_tokens": 1, "temperature": 0},
            )
            for p in prompts
        ]
        while len(got) < len(prompts):
            got.append(reader.get(timeout=300, copy=True).request_id)
        for f in futures:
            assert f.result()["kv_transfer_params"]["hidden_states"]["status"] != "failed"
        labels = {"model_name": str(tiny_llama), "engine": "0"}
        blocks = [-(-len(p) // BLOCK) for p in prompts]
        writes = sum(min(nb, 2) for nb in blocks)  # rank 1's stripe of a 1-block sample is empty
        text, _ = wait_for_values(
            server.http,
            [
                (P + "samples_shipped_total", labels, len(prompts)),
                (P + "samples_delivered_total", labels, len(prompts)),
                (P + "written_bytes_total", labels, sum(blocks) * BLOCK_BYTES),
                (P + "writes_total", labels, writes),
                (P + "write_latency_seconds_count", labels, writes),
                (P + "credit_wait_seconds_count", labels, 2 * len(prompts)),
                (P + "samples_in_flight", labels, 0),
                (P + "kv_blocks_held", labels, 0),
                (P + "readers_reachable", labels, 1),
            ],
            timeout=120,
        )
        print(excerpt(text, P))
