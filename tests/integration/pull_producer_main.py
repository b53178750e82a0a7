"""A real producer side of pull delivery in its own process, without vLLM: a deterministic
cache tensor, one ``PullServer`` per rank (each with its own NIXL agent, as each
tensor-parallel rank has), the samples of its JSON spec held in them. It prints one JSON
line with each sample's handle, then answers commands on stdin, one a line: "poll" (the
engine's step: prints the request ids each rank freed since, and how many it holds),
"garble REQUEST_ID" (changes the first state of the sample's first block in the cache, as
a step reusing it would; prints "garbled"), "quit". The spec's "checksum" is the
connector's option ("auto" by default), resolved per rank as the connector does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kv_connector.producer.options import ChecksumOption
from kv_connector.producer.pull_server import PullServer
from kv_connector.wire.handle import PullHandle, make_nonce
from kv_connector.wire.layout import BlockLayout
from tests.integration.common import make_cache, token_ids


def main() -> int:
    spec = json.loads(sys.argv[1])
    layout = BlockLayout(**spec["layout"])
    cache = make_cache(
        layout, spec["num_cache_blocks"], spec["seed"], finite=True, pad_bytes=spec.get("pad_bytes", 0)
    )
    world = spec.get("world_size", 1)
    producer_id = spec.get("producer_id", "producer")
    checksum = ChecksumOption(spec.get("checksum", "auto")).resolve(cache.is_cuda, layout)
    servers = [
        PullServer(
            cache,
            layout,
            spec["layer_ids"],
            producer_id,
            rank,
            world,
            ("127.0.0.1", 0),
            spec.get("timeout_s", 300.0),
            checksum=checksum,
        )
        for rank in range(world)
    ]
    endpoints = [s.address for s in servers]
    handles = {}
    for s in spec["samples"]:
        rid, nonce = s["request_id"], make_nonce()
        for server in servers:
            server.hold(rid, nonce, token_ids(rid, s["num_tokens"]), s["block_ids"], s.get("sample_id"))
        handles[rid] = PullHandle(producer_id, rid, nonce, endpoints).encode()
    for server in servers:
        server.finished(handles)  # as vLLM's finish does: the handles are out, the clocks start
    print(json.dumps({"handles": handles, "endpoints": endpoints}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "poll":
            freed = [sorted(s.take_freed()) for s in servers]
            print(json.dumps({"freed": freed, "held": [s.held for s in servers]}), flush=True)
        elif cmd.startswith("garble "):
            block = next(s for s in spec["samples"] if s["request_id"] == cmd.split()[1])["block_ids"][0]
            cache[block].view(-1)[0] += 1  # token 0 of layer 0 in either layout
            print(json.dumps("garbled"), flush=True)
        elif cmd == "quit":
            break
    for server in servers:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
