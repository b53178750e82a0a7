"""Producers and readers on separate "nodes": network namespaces joined by veth pairs on
one bridge, UCX over TCP, traffic only inside them. Producer ranks are real processes
driving HiddenStatesConnector with real vLLM objects (scripts/support/harness_rank.py); readers
are the real reader CLI. Every sample must arrive byte-exact, exactly once."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from kv_connector.wire.layout import stripe
from scripts.support.deaths import FAULT_ENV, explain
from scripts.support.harness_rank import sample_states, sample_tokens
from scripts.support.netns import Cluster, NetnsUnavailable, Node, check_available
from scripts.support.vllm_harness import config_only_model, file_store_init_method

pytestmark = [pytest.mark.integration, pytest.mark.multinode, pytest.mark.slow]

LAYERS = [1, 2, 3]
HIDDEN = 512
BLOCK = 128
BLOCK_BYTES = BLOCK * len(LAYERS) * HIDDEN * 2  # bf16
READER_PORT = 5555
# the reader listens on 0.0.0.0 inside its namespace: it refuses to without a secret
SECRET = {"KV_CONNECTOR_SECRET": secrets.token_hex(16)}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    try:
        check_available()
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces unavailable: {e}")
    with Cluster() as c:
        yield c


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return config_only_model(tmp_path_factory.mktemp("m") / "cfg-llama", HIDDEN, num_layers=4)


def start_reader(
    cluster: Cluster, node: Node, out: Path, n: int, pool_mib: float = 64
) -> subprocess.Popen[str]:
    return cluster.run(
        node,
        [
            sys.executable, "-m", "kv_connector.reader",
            "--listen", f"0.0.0.0:{READER_PORT}", "--out", str(out),
            "--max-samples", str(n), "--pool-mib", str(pool_mib), "--timeout", "240",
        ],
        env={**SECRET, "PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN"},
    )  # fmt: skip


def start_ranks(
    cluster: Cluster,
    node: Node,
    tmp: Path,
    model: Path,
    producer: str,
    tp: int,
    readers: list[str],
    requests: list[dict[str, Any]],
    **extra: Any,
) -> list[subprocess.Popen[str]]:
    init_method = file_store_init_method(tmp)  # the ranks' rendezvous, as vLLM's executor makes it
    procs = []
    for rank in range(tp):
        spec = dict(
            model_dir=str(model), layer_ids=LAYERS, tp=tp, rank=rank,
            init_method=init_method, readers=readers, producer_id=producer,
            requests=requests, **extra,
        )  # fmt: skip
        f = tmp / f"{producer}-r{rank}.json"
        f.write_text(json.dumps(spec))
        procs.append(
            cluster.run(
                node,
                [sys.executable, "-m", "scripts.support.harness_rank", str(f)],
                env={
                    **SECRET,
                    "PYTHONPATH": str(REPO),
                    "OMP_NUM_THREADS": "1",
                    **FAULT_ENV,
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                },
            )
        )
    return procs


def succeeded(proc: subprocess.Popen[str], timeout: float) -> None:
    """``proc`` exits 0 within ``timeout`` (its pipes read and closed, which wait() leaves open)."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"process timed out:\n{(err or '')[-3000:]}") from None
    why = explain(err or "", proc.returncode, "harness rank")
    assert proc.returncode == 0, f"rc={proc.returncode} {why}\n{(err or '')[-4000:]}"


def wait_all(procs: list[subprocess.Popen[str]], timeout: float = 400) -> list[dict[str, Any]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            raise AssertionError(f"process timed out:\n{stderr[-3000:]}") from None
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        why = explain(stderr, p.returncode, "harness rank")
        assert p.returncode == 0 and lines, f"rc={p.returncode} {why}\n{stderr[-4000:]}"
        out.append(json.loads(lines[-1]))
    return out


def check_files(out: Path, by_producer: dict[str, list[dict[str, Any]]]) -> None:
    """Exactly one file per request, in its producer's directory, byte-exact."""
    files = sorted(str(f.relative_to(out)) for f in out.rglob("*.safetensors"))
    assert files == sorted(f"{p}/{r['id']}.safetensors" for p, rs in by_producer.items() for r in rs)
    for p, r in ((p, r) for p, rs in by_producer.items() for r in rs):
        with safe_open(str(out / p / f"{r['id']}.safetensors"), "pt") as f:
            hs, tok = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        want = sample_states(r["id"], r["tokens"], len(LAYERS), HIDDEN, torch.bfloat16)
        assert tok.tolist() == sample_tokens(r["id"], r["tokens"])
        assert hs.shape == want.shape and torch.equal(hs.view(torch.int16), want.view(torch.int16)), r["id"]


def reqs(prefix: str, sizes: list[int]) -> list[dict[str, Any]]:
    return [{"id": f"{prefix}-{i}", "tokens": n} for i, n in enumerate(sizes)]


# block counts 1, 1, 2, 4, 5, 13, 3, 16: several do not divide by 4
SIZES = [1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 5 * BLOCK, 13 * BLOCK - 7, 2 * BLOCK + 1, 16 * BLOCK]


def test_tp4_producer_node_stripes_every_sample_over_its_four_ranks(
    cluster: Cluster, model_dir: Path, tmp_path: Path
) -> None:
    a, b = cluster.add_node("A"), cluster.add_node("B")
    requests = reqs("tp4", SIZES)
    out = tmp_path / "out"
    reader = start_reader(cluster, b, out, len(requests))
    results = wait_all(
        start_ranks(cluster, a, tmp_path, model_dir, "nodeA", 4, [f"{b.address}:{READER_PORT}"], requests)
    )
    succeeded(reader, 120)
    check_files(out, {"nodeA": requests})
    # each rank carried exactly its stripe of every sample, over its own NIXL agent
    for res in results:
        want = sum(len(stripe(-(-r["tokens"] // BLOCK), res["rank"], 4)) for r in requests) * BLOCK_BYTES
        assert res["bytes"] == want and sorted(res["finished"]) == sorted(r["id"] for r in requests)
    total = sum(-(-r["tokens"] // BLOCK) for r in requests) * BLOCK_BYTES
    assert sum(r["bytes"] for r in results) == total


def test_two_producer_nodes_into_one_reader(cluster: Cluster, model_dir: Path, tmp_path: Path) -> None:
    a1, a2, b = cluster.add_node("A1"), cluster.add_node("A2"), cluster.add_node("B")
    r1, r2 = reqs("p1", SIZES[:5]), reqs("p2", SIZES[3:])
    out = tmp_path / "out"
    reader = start_reader(cluster, b, out, len(r1) + len(r2))
    addr = [f"{b.address}:{READER_PORT}"]
    procs = start_ranks(cluster, a1, tmp_path, model_dir, "nodeA1", 2, addr, r1)
    procs += start_ranks(cluster, a2, tmp_path, model_dir, "nodeA2", 1, addr, r2)
    wait_all(procs)
    succeeded(reader, 120)
    check_files(out, {"nodeA1": r1, "nodeA2": r2})


def test_one_producer_shards_samples_over_two_readers_and_a_gone_one_stalls_nobody(
    cluster: Cluster, model_dir: Path, tmp_path: Path
) -> None:
    a, b1, b2, b3 = (cluster.add_node(n) for n in ("A", "B1", "B2", "B3"))
    requests = reqs("sh", SIZES + SIZES[:4])
    readers = [f"{n.address}:{READER_PORT}" for n in (b1, b2)]
    # round robin: 6 samples each, in the order their prompts complete
    outs = [tmp_path / "o1", tmp_path / "o2"]
    procs = [start_reader(cluster, n, o, len(requests) // 2) for n, o in zip((b1, b2), outs, strict=True)]
    results = wait_all(
        start_ranks(cluster, a, tmp_path, model_dir, "shard", 2, readers, requests, sharding="round_robin")
    )
    for p in procs:
        succeeded(p, 120)
    where = results[0]["readers_of"]
    assert where == results[1]["readers_of"]  # every rank sent each sample to the same reader
    for reader, out in zip(readers, outs, strict=True):
        check_files(out, {"shard": [r for r in requests if where[r["id"]] == reader]})

    # B3 runs no reader: its share fails after the connect deadline, B1's share arrives
    requests2 = reqs("gone", SIZES)
    readers2 = [f"{b1.address}:{READER_PORT}", f"{b3.address}:{READER_PORT}"]
    out = tmp_path / "o3"
    live = [r for r in requests2 if zlib.crc32(r["id"].encode()) % 2 == 0]  # request_hash routes to B1
    assert 0 < len(live) < len(requests2)
    reader = start_reader(cluster, b1, out, len(live))
    results = wait_all(
        start_ranks(cluster, a, tmp_path, model_dir, "gone", 1, readers2, requests2, connect_timeout_s=3.0)
    )
    succeeded(reader, 120)
    check_files(out, {"gone": live})
    dead = {r["id"] for r in requests2} - {r["id"] for r in live}
    assert set(results[0]["failed"]) == dead
    assert all("cannot reach the reader" in why for why in results[0]["failed"].values())


def test_a_full_reader_delays_only_its_own_samples(cluster: Cluster, model_dir: Path, tmp_path: Path) -> None:
    a, fast, slow = cluster.add_node("A"), cluster.add_node("F"), cluster.add_node("S")
    requests = reqs("full", [BLOCK] * 8)
    readers = [f"{fast.address}:{READER_PORT}", f"{slow.address}:{READER_PORT}"]
    out = tmp_path / "fast"
    fast_reader = start_reader(cluster, fast, out, 4)
    # the slow reader's pool holds one sample and its trainer takes nothing until the fast
    # reader has all of its samples: a full reader that delayed the others would stall this
    busy = tmp_path / "fast-reader-done"
    slow_reader = cluster.run(
        slow,
        [sys.executable, "-m", "scripts.bench.multinode", "--reader-node", f"0.0.0.0:{READER_PORT}",
         "--samples", "4", "--pool-mib", str(BLOCK_BYTES / (1 << 20)), "--hold-until", str(busy)],
        env={**SECRET, "PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN"},
    )  # fmt: skip
    ranks = start_ranks(cluster, a, tmp_path, model_dir, "full", 1, readers, requests, sharding="round_robin")
    succeeded(fast_reader, 300)
    fast_done = time.time()
    busy.touch()
    check_files(out, {"full": requests[0::2]})
    assert slow_reader.stdout is not None
    slow_out, _ = slow_reader.communicate(timeout=300)
    slow_res = json.loads(slow_out.splitlines()[-1])
    # the fast reader had all its samples while the full one still took nothing
    assert fast_done < slow_res["first_take"]
    assert sorted(slow_res["ids"]) == sorted(r["id"] for r in requests[1::2])
    (res,) = wait_all(ranks)
    assert not res["failed"] and sorted(res["finished"]) == sorted(r["id"] for r in requests)
