"""A real producer side of pull delivery in its own process, without vLLM: a deterministic
cache tensor, one ``PullServer`` per rank (each with its own NIXL agent, as each
tensor-parallel rank has), the samples of its JSON spec held in them. It prints one JSON
line with each sample's handle, then answers commands on stdin, one a line: "poll" (the
engine's step: prints the request ids each rank freed since, and how many it holds),
"garble REQUEST_ID" (changes the first state of the sample's first block in the cache, as
a step reusing it would; prints "garbled"), "fault REQUEST_ID KIND" (the faults of
docs/reliability.md, applied to the cache: "slot" token 1's slot, every layer, overwritten
with another sample's row, as a late write of another request would; "tail" the last
three token slots of its first block zeroed; "swap" its first block replaced by another
block; "layer" its second captured layer zeroed over the whole sample; "bit" one bit
flipped in a word no fingerprint samples; prints "faulted"), "end REQUEST_ID HOW" (the
hold ends right after each rank answers the sample's next fetch, while the consumer
READs: HOW "released" or "reassigned"; prints "ending"), "hold SAMPLES" (more samples,
a JSON list as the spec's, held as the first ones were; prints their handles), "reset"
(every hold ends, the cache is as it was made, what was freed is forgotten: the next test
of a module finds the process as new; prints how many each rank holds), "quit". The
spec's "fences"
(default true) is the servers' option. The spec's "checksum" is the connector's
option ("auto" by default), resolved per rank as the connector does; a sample's
fingerprint words are taken when it is held, as the worker side takes them in the step
that wrote its slots. A sample's "before" (a fault's kind) is applied before that: states
the step itself wrote bad."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kv_connector.cache.blocks import CacheBlocks
from kv_connector.producer.fingerprints import Fingerprints
from kv_connector.producer.options import ChecksumOption
from kv_connector.producer.pull.server import PullServer, PullServerConfig
from kv_connector.wire import fingerprint, protocol
from kv_connector.wire.handle import PullHandle, make_nonce
from kv_connector.wire.layout import BlockLayout
from tests.integration.common import make_cache, token_ids


def fault(
    cache: torch.Tensor, layout: BlockLayout, samples: list[dict[str, Any]], rid: str, kind: str
) -> None:
    """One fault of docs/reliability.md on sample ``rid``'s blocks in ``cache``."""
    table = next(s for s in samples if s["request_id"] == rid)["block_ids"]
    view = cache if layout.layout == "TLH" else cache.permute(0, 2, 1, 3)  # [block, token, L, H]
    used = {b for s in samples for b in s["block_ids"]}
    spare = next(b for b in range(cache.shape[0]) if b not in used)
    if kind == "slot":
        view[table[0], 1] = view[spare, 0]
    elif kind == "tail":
        view[table[0], -3:] = 0
    elif kind == "swap":
        cache[table[0]] = cache[spare]
    elif kind == "layer":
        for b in table:
            view[b, :, 1] = 0
    elif kind == "bit":  # token 1, layer 0: a word its fingerprint does not sample
        words = layout.row_bytes // 8
        seed = fingerprint.seed_of(rid)
        word = fingerprint.coordinates(seed, np.array([1]), layout.num_layers, words, layout.block_size)
        spared = next(w for w in range(words) if w != word[0, 0])
        view[table[0], 1, 0].view(torch.uint8)[8 * spared] ^= 1
    else:
        raise ValueError(kind)


class EndingServer(PullServer):
    """A rank whose holds named in ``ending`` end right after it answers their fetch, while
    the consumer READs: "released" as a second consumer's release would end it, or
    "reassigned" (preempted, and another sample's row lands in the blocks, as vLLM's reuse
    writes them)."""

    def __init__(
        self, cache: torch.Tensor, config: PullServerConfig, held: dict[str, dict[str, Any]]
    ) -> None:
        super().__init__(cache, config)
        self.cache, self.samples = cache, held  # the samples held, by request id (main's)
        self.ending: dict[str, str] = {}

    def answer(
        self, msg: protocol.Message
    ) -> protocol.PullShare | protocol.PullReleased | protocol.PullKept | protocol.PullError:
        out = super().answer(msg)
        if not isinstance(out, protocol.PullShare) or not isinstance(msg, protocol.PullFetch):
            return out
        how = self.ending.pop(msg.request_id, None)
        if how == "released":
            self.answer(protocol.PullRelease(request_id=msg.request_id, nonce=msg.nonce))
        elif how == "reassigned":
            self.preempt([msg.request_id])
            fault(self.cache, self.layout, list(self.samples.values()), msg.request_id, "slot")
        return out


def hold_all(
    servers: list[EndingServer],
    cache: torch.Tensor,
    layout: BlockLayout,
    samples: list[dict[str, Any]],
    held: dict[str, dict[str, Any]],
) -> dict[str, str]:
    """Hold ``samples`` on every rank (the states of one with a "before" fault written bad
    first), add them to ``held``, start their clocks; their handles."""
    held.update((s["request_id"], s) for s in samples)
    for s in samples:  # states bad from the start ("before": a fault's kind): the step wrote them so
        if s.get("before"):
            fault(cache, layout, list(held.values()), s["request_id"], s["before"])
    producer_id, endpoints = servers[0].config.producer_id, [s.address for s in servers]
    handles = {}
    for s in samples:
        rid, nonce = s["request_id"], make_nonce()
        for server in servers:
            words = Fingerprints(CacheBlocks(cache, layout), layout.block_size).ship(
                rid, s["num_tokens"], s["block_ids"]
            )
            tokens = token_ids(rid, s["num_tokens"])
            server.hold(rid, nonce, tokens, s["block_ids"], s.get("sample_id"), words=words)
        handles[rid] = PullHandle(producer_id, rid, nonce, endpoints).encode()
    for server in servers:
        server.finished(handles)  # as vLLM's finish does: the handles are out, the clocks start
    return handles


def main() -> int:
    spec = json.loads(sys.argv[1])
    layout = BlockLayout(**spec["layout"])
    cache = make_cache(
        layout, spec["num_cache_blocks"], spec["seed"], finite=True, pad_bytes=spec.get("pad_bytes", 0)
    )
    made = cache.clone()
    world = spec.get("world_size", 1)
    checksum = ChecksumOption(spec.get("checksum", "auto")).resolve(cache.is_cuda, layout)
    held: dict[str, dict[str, Any]] = {}  # the samples held since the start or the last reset
    servers = [
        EndingServer(
            cache,
            PullServerConfig(
                layout,
                tuple(spec["layer_ids"]),
                spec.get("producer_id", "producer"),
                ("127.0.0.1", 0),
                spec.get("timeout_s", 300.0),
                rank,
                world,
                checksum=checksum,
                fences=spec.get("fences", True),
            ),
            held,
        )
        for rank in range(world)
    ]
    handles = hold_all(servers, cache, layout, spec["samples"], held)
    print(json.dumps({"handles": handles, "endpoints": [s.address for s in servers]}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "poll":
            freed = [sorted(s.take_freed()) for s in servers]
            print(json.dumps({"freed": freed, "held": [s.held for s in servers]}), flush=True)
        elif cmd.startswith("garble "):
            block = held[cmd.split()[1]]["block_ids"][0]
            cache[block].view(-1)[0] += 1  # token 0 of layer 0 in either layout
            print(json.dumps("garbled"), flush=True)
        elif cmd.startswith("fault "):
            _, rid, kind = cmd.split()
            fault(cache, layout, list(held.values()), rid, kind)
            print(json.dumps("faulted"), flush=True)
        elif cmd.startswith("end "):
            _, rid, how = cmd.split()
            for server in servers:
                server.ending[rid] = how
            print(json.dumps("ending"), flush=True)
        elif cmd.startswith("hold "):
            print(json.dumps(hold_all(servers, cache, layout, json.loads(cmd[5:]), held)), flush=True)
        elif cmd == "reset":
            for server in servers:
                server.drop(list(held))
                server.ending.clear()
                server.take_freed()
            held.clear()
            cache.copy_(made)
            print(json.dumps([s.held for s in servers]), flush=True)
        elif cmd == "quit":
            break
    for server in servers:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
