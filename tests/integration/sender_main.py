"""A real producer-side sender in its own process: builds a deterministic cache tensor,
ships the samples named in its JSON spec through HiddenStatesSender, waits for every
acknowledgement and prints one JSON line with what finished and what failed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kv_connector.layout import BlockLayout
from kv_connector.sender import HiddenStatesSender, SenderConfig
from tests.integration.common import make_cache, token_ids


def main() -> int:
    spec = json.loads(sys.argv[1])
    layout = BlockLayout(**spec["layout"])
    cache = make_cache(layout, spec["num_cache_blocks"], spec["seed"])
    cfg = SenderConfig(
        consumer_address=spec["address"],
        producer_id=spec.get("producer_id", "producer"),
        rank=spec.get("rank", 0),
        world_size=spec.get("world_size", 1),
        connect_timeout_s=spec.get("connect_timeout_s", 30.0),
    )
    sender = HiddenStatesSender(cfg, cache, layout, spec.get("layer_ids", list(range(layout.num_layers))))
    t0 = time.monotonic()
    for s in spec["samples"]:
        sender.ship(s["request_id"], token_ids(s["request_id"], s["num_tokens"]), s["block_ids"])
    want = {s["request_id"] for s in spec["samples"]}
    finished: list[str] = []
    failed: dict[str, str] = {}
    deadline = t0 + spec.get("timeout_s", 60.0)
    while len(finished) + len(failed) < len(want) and time.monotonic() < deadline:
        finished += sender.take_finished()
        failed.update(sender.take_failed())
        time.sleep(0.002)
    elapsed = time.monotonic() - t0
    stats = dict(sender.stats)
    sender.close()
    print(
        json.dumps({"finished": finished, "failed": failed, "elapsed_s": elapsed, "stats": stats}), flush=True
    )
    return 0 if set(finished) == want and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
