"""With vLLM's prefix caching on, a request whose first blocks are cache hits (computed by
an earlier request) ships one row per token, and the hit rows are that prefix's states:
every sample exact against transformers. (vLLM's own hidden-state connector ships only
the computed tokens there, vLLM #44485.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_connector.reader import HiddenStatesReader
from tests.e2e.conftest import Reference, check_samples, prompts_of, run_and_collect

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LAYER_IDS = [1, 2, 4]
BLOCK = 128


def test_prefix_cache_hits_ship_every_token_row_exact(tiny_llama: Path, llama_reference: Reference) -> None:
    (prefix,) = prompts_of([2 * BLOCK + 7], seed=60)
    tails = prompts_of([5, BLOCK + 3, 1], seed=61)
    prompts = [prefix] + [prefix + t for t in tails]
    with HiddenStatesReader() as reader:
        spec = dict(
            model=str(tiny_llama), address=reader.address, layer_ids=LAYER_IDS, block_size=BLOCK,
            prompts=prompts, enable_prefix_caching=True, max_num_seqs=1,  # one after the other: hits
        )  # fmt: skip
        got, res, _ = run_and_collect(reader, spec, len(prompts))
    cached = [o["num_cached_tokens"] for o in res["outputs"]]
    assert cached[0] == 0 and all(c >= 2 * BLOCK for c in cached[1:]), cached  # the prefix's full blocks hit
    check_samples(got, res, prompts, llama_reference, LAYER_IDS, set())
