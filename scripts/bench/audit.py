"""What the logprob audit (``kv_connector.audit``) costs the consumer, on one thread of
this machine's CPU: an 8B-shaped verifier's last layer (hidden 4096, vocab 128256, bf16
``lm_head``) at the audited positions of one row, against the consumer's own per-sample
work for the same row (the default record's check and the values screen on the lines it
reads, ``reader.pool.memory.fingerprint_screened``, as a host pool runs it).

    python -m scripts.bench.audit     # about a minute; last line JSON

``audit_share_of_consumer_cpu``: the audit's CPU at the default rate (``audit.DEFAULT_RATE``
of the rows) over the consumer's CPU per row (target <= 0.01).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from scripts.bench.integrity import least_cpu_s

HIDDEN, VOCAB, LAYERS, TOKENS, BLOCK = 4096, 128256, 4, 2048, 16


def main() -> dict[str, Any]:
    return measure(HIDDEN, VOCAB, TOKENS)


def measure(hidden: int, vocab: int, tokens_n: int) -> dict[str, Any]:
    """The audit's and the consumer's CPU for one row of ``tokens_n`` tokens at this shape."""
    from kv_connector.audit import DEFAULT_POSITIONS, DEFAULT_RATE, LogprobAudit, positions_of
    from kv_connector.cache.blocks import CacheBlocks
    from kv_connector.reader.pool.memory import fingerprint_screened
    from kv_connector.wire.identity import NO_IDENTITY
    from kv_connector.wire.layout import BlockLayout

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    audit = LogprobAudit(
        torch.ones(hidden), torch.randn(vocab, hidden, generator=gen, dtype=torch.bfloat16) * 0.02, 1e-5, 32
    )
    states = torch.randn(tokens_n, LAYERS, hidden, generator=gen, dtype=torch.bfloat16)
    tokens = torch.randint(0, vocab, (tokens_n,), generator=gen)
    layer_ids = [2, 16, 29, 32]
    positions = positions_of(tokens_n, DEFAULT_POSITIONS, "row-0")
    ref = {p: -5.0 for p in positions}
    audit_s = least_cpu_s(lambda: audit.check(tokens, states, layer_ids, ref))

    g = BlockLayout("TLH", BLOCK, LAYERS, hidden, "bfloat16")
    nb = g.blocks_for(tokens_n)
    cache = states.view(nb, BLOCK, LAYERS, hidden)
    blocks = CacheBlocks(cache, g)
    share = blocks.share_of("r", tokens.tolist(), list(range(nb)), layer_ids, NO_IDENTITY, 0, 1)
    consumer_s = least_cpu_s(lambda: fingerprint_screened(states, share.manifest, list(share.share)))
    per_row = DEFAULT_RATE * audit_s
    return {
        "shape": dict(hidden=hidden, vocab=vocab, layers=LAYERS, tokens=tokens_n, positions=len(positions)),
        "audit_ms_per_sample": round(audit_s * 1e3, 2),
        "consumer_ms_per_sample": round(consumer_s * 1e3, 3),
        "rate": DEFAULT_RATE,
        # three significant digits: at a small shape the share is below 1e-4, and a fixed
        # number of decimals would round it to 0
        "audit_share_of_consumer_cpu": float(f"{per_row / (per_row + consumer_s):.3g}"),
    }


if __name__ == "__main__":
    argparse.ArgumentParser(prog="python -m scripts.bench.audit", description=__doc__).parse_args()
    print(json.dumps(main()), flush=True)
