"""What each integrity record costs per GB of hidden states at each end, on one thread of
this machine's CPU (docs/reliability.md's fault table): the producer's part (fingerprint
words gathered from a cache's slots as a step writes them; XXH3 over a share's bytes in
place; block digests with torch) and the reader's (the same record recomputed from a
landed sample; the values screen over it, alone or on the lines the fingerprint reads).
GPU-sized states: 4 captured layers x hidden 4096, bf16, both block layouts; best of a
few rounds, CPU seconds per GB of states.

    python -m scripts.bench.integrity     # a few seconds; last line JSON
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

BLOCK, LAYERS, HIDDEN = 16, 4, 4096


def least_cpu_s(fn: Callable[[], object], rounds: int = 5) -> float:
    """The least CPU seconds of ``rounds`` calls (process time: this thread's work)."""
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return min(out)


def measure(tokens: int = 4096, layout: str = "TLH") -> dict[str, Any]:
    from kv_connector.cache.blocks import CacheBlocks
    from kv_connector.producer.fingerprints import Fingerprints
    from kv_connector.producer.planning import BlockRecorder, StepSlice
    from kv_connector.reader.pool.memory import fingerprint_screened
    from kv_connector.reader.pool.values import find_bad_values
    from kv_connector.wire import fingerprint
    from kv_connector.wire.block_digest import checksum_of_digests, sample_block_digests
    from kv_connector.wire.identity import NO_IDENTITY
    from kv_connector.wire.integrity import sample_checksum
    from kv_connector.wire.layout import BlockLayout
    from kv_connector.wire.protocol import ShareChecksum

    torch.set_num_threads(1)
    g = BlockLayout(layout, BLOCK, LAYERS, HIDDEN, "bfloat16")  # type: ignore[arg-type]
    nb = g.blocks_for(tokens)
    cache = torch.randn(2 * nb, *g.block_shape()).to(torch.bfloat16)
    table = list(range(0, 2 * nb, 2))  # every other block: scattered as vLLM's are
    blocks = CacheBlocks(cache, g)
    share = blocks.share_of("req-0", list(range(tokens)), table, list(range(LAYERS)), NO_IDENTITY, 0, 1)
    gb = tokens * g.token_bytes / 1e9

    def step_words() -> None:  # one prefill step writing the sample, and its ship
        fp, rec = Fingerprints(blocks, BLOCK), BlockRecorder(BLOCK)
        planned, _ = rec.slots_of([StepSlice("req-0", 0, tokens, tuple(table))])
        fp.take(planned)
        fp.ship("req-0", tokens, table).record(share.manifest, share.share)

    # the landed sample as the reader's pool holds it: [T, L, H] rows, dense
    view = cache if layout == "TLH" else cache.permute(0, 2, 1, 3)
    landed = torch.cat([view[b] for b in table])[:tokens].contiguous()
    pool = landed.view(-1).view(torch.uint8).numpy()
    m, js = share.manifest, list(share.share)
    out: dict[str, Any] = {
        "layout": layout,
        "sample_mib": round(tokens * g.token_bytes / (1 << 20), 1),
        "producer_cpu_s_per_GB": {
            "fingerprint": least_cpu_s(step_words) / gb,
            "xxh3": least_cpu_s(lambda: blocks.record(ShareChecksum.XXH3, share)) / gb,
            "blocks": least_cpu_s(lambda: blocks.record(ShareChecksum.BLOCKS, share)) / gb,
        },
        "reader_cpu_s_per_GB": {
            "fingerprint": least_cpu_s(lambda: fingerprint.states_record(landed, m, js)) / gb,
            "xxh3": least_cpu_s(lambda: sample_checksum(pool.data, 0, m, js)) / gb,
            "blocks": least_cpu_s(
                lambda: checksum_of_digests(m, js, sample_block_digests(landed, m, js))
            )
            / gb,
            "values_screen": least_cpu_s(lambda: find_bad_values(landed, list(range(LAYERS)))) / gb,
            "values_screen_sampled": least_cpu_s(
                lambda: find_bad_values(landed, list(range(LAYERS)), sample=True)
            )
            / gb,
            # the default at a host pool: the fingerprint, and the screen on the lines it reads
            "fingerprint_and_screen": least_cpu_s(lambda: fingerprint_screened(landed, m, js)) / gb,
        },
    }
    for end in ("producer_cpu_s_per_GB", "reader_cpu_s_per_GB"):
        out[end] = {k: round(v, 4) for k, v in out[end].items()}
    out["fingerprint_bytes_read_fraction"] = round(LAYERS * 8 / g.token_bytes, 6)
    return out


def main() -> dict[str, Any]:
    return {layout: measure(layout=layout) for layout in ("TLH", "LTH")}


if __name__ == "__main__":
    argparse.ArgumentParser(prog="python -m scripts.bench.integrity", description=__doc__).parse_args()
    print(json.dumps(main()), flush=True)
