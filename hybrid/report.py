"""The KV cache of a hybrid model with hidden-state extraction, and what one sample costs to ship.

    python -m hybrid.report --config CONFIG.json --layers 2,24,45,47 --budget-gib 20

The models are hybrid ones (Qwen3-Next, Qwen3.5, linear-attention-only) or mixed-window
ones (gpt-oss). It sets vLLM's own-group approach next to the supplementary-tensor design,
or next to the fallback to vLLM's grouping that a model without a full-attention group
gets. ``shipping`` gives a sample's blocks, descriptors and bytes. The report is one JSON
object on stdout.

Runs on CPU without weights; ``--config`` is a config.json file or a model directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hybrid.shapes import HybridShape, parse_layer_ids


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {p}")
    data: dict[str, Any] = json.loads(p.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid.report", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="config.json or a model directory")
    ap.add_argument("--layers", required=True, help="captured layer ids, e.g. 2,24,45,47")
    ap.add_argument("--budget-gib", type=float, required=True, help="KV cache memory, GiB")
    ap.add_argument("--dtype", default=None, help="model dtype (default: the config's)")
    ap.add_argument("--max-model-len", type=int, default=32768, help="request length (default 32768)")
    ap.add_argument(
        "--platform",
        choices=["cuda", "cpu"],
        default="cuda",
        help="whose attention backend and block alignment: cuda (default; the figures do not depend on "
        "this host) or cpu (vLLM's CPU build on this host, whose CPU decides the SSM state dtype)",
    )
    ap.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="the target's attention block size, e.g. from its log ('Setting attention block size to N "
        "tokens'); default: what vLLM's alignment picks for --platform",
    )
    ap.add_argument(
        "--sample-tokens",
        type=int,
        default=2048,
        help="tokens of the sample whose shipping cost is reported (default 2048)",
    )
    ap.add_argument(
        "--no-prefix-caching", action="store_true", help="mamba cache mode 'none' instead of 'align'"
    )
    ap.add_argument("--verbose", action="store_true", help="keep vLLM's log (INFO) on stderr")
    args = ap.parse_args(argv)

    from hybrid.accounting import Setup, compare

    # vLLM configured its logger on import: quiet it now
    if not args.verbose:
        logging.getLogger("vllm").setLevel(logging.ERROR)

    try:
        shape = HybridShape.from_config(load_config(args.config), dtype=args.dtype)
        setup = Setup(
            layer_ids=tuple(parse_layer_ids(args.layers, shape.num_layers)),
            budget_bytes=int(args.budget_gib * (1 << 30)),
            max_model_len=args.max_model_len,
            platform=args.platform,
            prefix_caching=not args.no_prefix_caching,
            block_size=args.block_size,
            sample_tokens=args.sample_tokens,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"hybrid.report: {e}", file=sys.stderr)
        return 2
    result = compare(shape, setup)
    s = result["setup"]
    print(
        f"hybrid.report: {s['platform']} target, attention block {s['attention_block_size']} tokens "
        f"({s['block_size_from']}), SSM state {s['ssm_state_dtype']}; this host's CPU: {s['host_cpu']}; "
        f"ours: {s['ours_is']}",
        file=sys.stderr,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    # vLLM logs to stdout by default; stdout is the JSON object's alone. Set here, for
    # this process only: main() called in-process must not change the environment that
    # later vLLM processes inherit.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    sys.exit(main())
