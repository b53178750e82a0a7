"""With vLLM's prefix caching on, a request whose first blocks are cache hits (computed by
an earlier request) ships one row per token, and the hit rows are that prefix's states:
every sample exact against transformers. (vLLM's own hidden-state connector ships only
the computed tokens there, vLLM #44485.)"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import LLAMA_BLOCK, LLAMA_LAYERS, Reference, check_samples, prompts_of
from tests.engines import Run, SharedProducer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_prefix_cache_hits_ship_every_token_row_exact(
    llama_push: SharedProducer, llama_reference: Reference
) -> None:
    """The shared engine caches prefixes: a prompt, then three that extend it (a later run:
    they hit its blocks), each sample exact over every token row."""
    assert llama_push.spec.enable_prefix_caching
    (prefix,) = prompts_of([2 * LLAMA_BLOCK + 7], seed=60)
    tails = prompts_of([5, LLAMA_BLOCK + 3, 1], seed=61)
    first = llama_push.collect(Run([prefix]), 1)
    assert first.result["outputs"][0]["num_cached_tokens"] == 0
    check_samples(first.samples, first.result, [prefix], llama_reference, LLAMA_LAYERS, set())
    prompts = [prefix + t for t in tails]
    out = llama_push.collect(Run(prompts), len(prompts))
    cached = [o["num_cached_tokens"] for o in out.result["outputs"]]
    assert all(c >= 2 * LLAMA_BLOCK for c in cached), cached  # the prefix's full blocks hit
    check_samples(out.samples, out.result, prompts, llama_reference, LLAMA_LAYERS, set())
