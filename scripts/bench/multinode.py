"""Run a multi-node scenario in network namespaces and print per-rank and total bytes/s.

    python -m scripts.bench.multinode --tp 1,4 --samples 16 --tokens 2048 [--producers 1] [--readers 1]

For each TP size given, on the same data: every producer rank runs in a namespace of its
own (its own veth link, as a GPU rank has its own NIC; the ranks of a producer meet over
the bridge for gloo), every reader in another; producer ranks drive HiddenStatesConnector
with real vLLM objects on GPU-sized states (4 captured layers x hidden 4096, bf16, 32 KiB
per token), UCX over TCP. Everything is torn down at the end, also on errors. Needs root.
On real nodes, run the reader CLI and vLLM as docs/usage.md shows instead.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.support.netns import Cluster
from scripts.support.vllm_harness import config_only_model

LAYERS = [1, 2, 3, 4]
HIDDEN = 4096
PORT = 5555
REPO = Path(__file__).resolve().parents[2]
HOLD_LIMIT_S = 300.0  # a held reader node's longest hold


def reader_node(listen: str, n: int, pool_mib: float, hold_until: Path | None = None) -> None:
    """Take ``n`` samples and print {"bytes", "ids", "first_take"}; with ``hold_until``,
    take nothing until that file exists (a trainer that is busy: its pool fills and stays
    full), at most ``HOLD_LIMIT_S``."""
    from kv_connector.reader import HiddenStatesReader

    with HiddenStatesReader(listen=listen, pool_bytes=int(pool_mib * (1 << 20))) as reader:
        print(json.dumps({"address": reader.address}), flush=True)
        deadline = time.monotonic() + HOLD_LIMIT_S
        while hold_until is not None and not hold_until.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        nbytes, ids, first = 0, [], time.time()
        for s in reader.samples(n, timeout=600):
            nbytes += s.hidden_states.numel() * s.hidden_states.element_size()
            ids.append(s.request_id)
        print(json.dumps({"bytes": nbytes, "ids": ids, "first_take": first}), flush=True)


def _json_line(proc: Any, timeout: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"a node process failed (rc={proc.returncode}):\n{err[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def scenario(
    work: Path, tp: int, producers: int, readers: int, samples: int, tokens: int, pool_mib: float
) -> dict[str, Any]:
    model = config_only_model(work / "wide-llama", HIDDEN, num_layers=4)
    env = {
        # the readers listen on 0.0.0.0 in their namespaces: with a secret, as in production
        "KV_CONNECTOR_SECRET": secrets.token_hex(16),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "NIXL_LOG_LEVEL": "WARN",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    with Cluster() as c:
        rnodes = [c.add_node(f"R{i}") for i in range(readers)]
        pnodes = [[c.add_node(f"P{p}r{r}") for r in range(tp)] for p in range(producers)]
        per_reader = samples * producers // readers
        reader_argv = [sys.executable, "-m", "scripts.bench.multinode", "--reader-node", f"0.0.0.0:{PORT}"]
        reader_argv += ["--samples", str(per_reader), "--pool-mib", str(pool_mib)]
        rprocs = [c.run(n, reader_argv, env=env) for n in rnodes]
        for p in rprocs:
            assert p.stdout is not None
            p.stdout.readline()  # the reader is listening
        addrs = [f"{n.address}:{PORT}" for n in rnodes]
        rank_procs = []
        for pi, nodes in enumerate(pnodes):
            requests = [{"id": f"p{pi}-s{i}", "tokens": tokens} for i in range(samples)]
            for r, node in enumerate(nodes):
                spec = dict(
                    model_dir=str(model), layer_ids=LAYERS, tp=tp, rank=r,
                    init_method=f"tcp://{nodes[0].address}:{29500 + pi}", readers=addrs,
                    sharding="round_robin", producer_id=f"producer{pi}", requests=requests,
                    num_blocks=4 * -(-tokens // 128) + 1, fill=False,
                )  # fmt: skip
                f = work / f"tp{tp}-p{pi}-r{r}.json"
                f.write_text(json.dumps(spec))
                rank_procs.append(
                    c.run(node, [sys.executable, "-m", "scripts.support.harness_rank", str(f)], env=env)
                )
        ranks = [_json_line(p, 900) for p in rank_procs]
        reads = [_json_line(p, 300) for p in rprocs]
    total = sum(r["bytes"] for r in reads)
    seconds = max(r["elapsed_s"] for r in ranks)  # ranks drive from admission to last ack
    return {
        "tp": tp,
        "per_rank": [
            {
                "rank": r["rank"],
                "bytes": r["bytes"],
                "GB_per_s": r["bytes"] / r["elapsed_s"] / 1e9,
                "share": r["bytes"] / total if total else 0.0,
            }
            for r in ranks
        ],
        "total_bytes": total,
        "total_GB_per_s": total / seconds / 1e9,
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", default="1,4", help="TP sizes to run, on the same data")
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--readers", type=int, default=1)
    ap.add_argument("--samples", type=int, default=16, help="samples per producer")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    ap.add_argument("--pool-mib", type=float, default=512)
    ap.add_argument("--reader-node", help=argparse.SUPPRESS)
    ap.add_argument("--hold-until", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.reader_node:
        reader_node(args.reader_node, args.samples, args.pool_mib, args.hold_until)
        return
    if args.samples * args.producers % args.readers:
        raise SystemExit("--samples x --producers must divide by --readers")
    results = []
    with tempfile.TemporaryDirectory(prefix="hs-multinode-") as tmp:
        for tp in [int(x) for x in args.tp.split(",")]:
            res = scenario(
                Path(tmp), tp, args.producers, args.readers, args.samples, args.tokens, args.pool_mib
            )
            results.append(res)
            for r in res["per_rank"]:
                print(
                    f"TP={tp} rank {r['rank']}: {r['bytes'] / 1e6:8.1f} MB ({r['share']:.0%} of the bytes), "
                    f"{r['GB_per_s']:.3f} GB/s"
                )
            mb, secs, rate = res["total_bytes"] / 1e6, res["seconds"], res["total_GB_per_s"]
            print(f"TP={tp} total: {mb:.1f} MB in {secs:.2f} s, {rate:.3f} GB/s")
    print(json.dumps({"scenarios": results}))


if __name__ == "__main__":
    main()
