"""A real producer-side sender in its own process: builds a deterministic cache tensor,
ships the samples named in its JSON spec through HiddenStatesSender, waits for every
acknowledgement and prints one JSON line with what finished and what failed."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kv_connector.cache.blocks import CacheBlocks
from kv_connector.producer.fingerprints import Fingerprints
from kv_connector.sender.config import CREDITS_AHEAD
from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
from kv_connector.wire.identity import make_identity
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.nixl_transport import NixlTransport
from kv_connector.wire.protocol import ShareChecksum
from kv_connector.wire.provenance import Provenance
from kv_connector.wire.ucx_choices import ucx_choices
from tests.integration.common import make_cache, token_ids
from tests.integration.faulty_transport import FaultyTransport


def main() -> int:
    spec = json.loads(sys.argv[1])
    layout = BlockLayout(**spec["layout"])
    cache = make_cache(
        layout, spec["num_cache_blocks"], spec["seed"], spec.get("finite", True), spec.get("pad_bytes", 0)
    )
    for s in spec["samples"]:  # fault injection: states that are not
        poison = s.get("poison")
        first = cache[s["block_ids"][0]]
        if poison == "nan":  # one value of token 0, layer 0
            first.view(-1)[0] = float("nan")
        elif poison == "zero":  # token 0 in every layer
            (first[:, 0] if layout.layout == "LTH" else first[0]).zero_()
        elif poison == "layer":  # captured layer 1 at every token of the sample
            for b in s["block_ids"]:
                (cache[b][1] if layout.layout == "LTH" else cache[b][:, 1]).zero_()
        elif poison == "nan-far":  # one value of token 0, layer 0 that a sampled screen does not read
            first.view(-1)[100] = float("nan")
    cfg = SenderConfig(
        consumer_address=spec["address"],
        producer_id=spec.get("producer_id", "producer"),
        rank=spec.get("rank", 0),
        world_size=spec.get("world_size", 1),
        connect_timeout_s=spec.get("connect_timeout_s", 30.0),
        checksum=(
            ShareChecksum(spec.get("kind", "blocks" if spec.get("block_digests") else "xxh3"))
            if spec.get("checksum", True)
            else None
        ),
        sample_timeout_s=spec.get("sample_timeout_s", 300.0),
        provenance=msgspec.convert(spec["provenance"], Provenance) if spec.get("provenance") else None,
        credits_ahead=spec.get("credits_ahead", CREDITS_AHEAD),
    )
    layer_ids = spec.get("layer_ids", list(range(layout.num_layers)))
    # fault injection through the transport: WRITEs that land wrong bytes, or that NIXL refuses
    transport = FaultyTransport(
        NixlTransport(f"{cfg.producer_id}-r{cfg.rank}-{os.getpid()}"),
        garble=spec.get("garble", []),
        garble_times=spec.get("garble_times"),
        misaddress=spec.get("misaddress", False),
        delay=spec.get("delay"),
    )
    sender = HiddenStatesSender(cfg, cache, layout, layer_ids, transport=transport)
    if spec.get("stage_checksum"):
        sender.blocks.stage = True  # checksum through the GPU cache's staging path, on CPU memory
    t0 = time.monotonic()
    want = {s["request_id"] for s in spec["samples"]}
    finished: list[str] = []
    failed: dict[str, str] = {}
    deadline = t0 + spec.get("timeout_s", 60.0)

    def settle() -> None:
        nonlocal finished
        finished += sender.take_finished()
        failed.update({rid: f.why for rid, f in sender.take_failed().items()})

    # ``in_flight``: at most that many samples unacknowledged at a time, shipped as earlier
    # ones are acknowledged (as an engine whose cache holds that many does); default all at once
    in_flight = spec.get("in_flight", len(spec["samples"]))
    for i, s in enumerate(spec["samples"]):
        while i - len(finished) - len(failed) >= in_flight and time.monotonic() < deadline:
            settle()
            time.sleep(0.001)
        # fingerprint words taken as the step that wrote the slots takes them
        words = Fingerprints(CacheBlocks(cache, layout), layout.block_size).ship(
            s["request_id"], s["num_tokens"], s["block_ids"]
        )
        sender.ship(
            s["request_id"],
            token_ids(s["request_id"], s["num_tokens"]),
            s["block_ids"],
            make_identity(s.get("sample_id"), s.get("metadata")),
            words=words,
        )
    if spec.get("exit_after_ship"):
        # like a vLLM worker at interpreter exit: an atexit hook drains what is unwritten
        def drain() -> None:
            end = time.monotonic() + 60
            while sender.unwritten and time.monotonic() < end:
                time.sleep(0.01)
            print(
                json.dumps(
                    {
                        "unwritten_at_exit": sender.unwritten,
                        "failed": {r: f.why for r, f in sender.take_failed().items()},
                    }
                ),
                flush=True,
            )
            sender.close()

        atexit.register(drain)
        return 0
    while len(finished) + len(failed) < len(want) and time.monotonic() < deadline:
        settle()
        time.sleep(0.002)
    elapsed = time.monotonic() - t0
    stats = sender.stats().as_dict()
    for timer in transport.timers:  # a delayed WRITE is posted whatever became of its job
        timer.join()
    time.sleep(0.5 if transport.timers else 0.0)  # and lands
    sender.close()
    print(
        json.dumps(
            {
                "finished": finished,
                "failed": failed,
                "elapsed_s": elapsed,
                "stats": stats,
                "garbled": transport.garbled,
                "transports": ucx_choices(),  # what its agent read or did for each pairing
            }
        ),
        flush=True,
    )
    return 0 if set(finished) == want and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
