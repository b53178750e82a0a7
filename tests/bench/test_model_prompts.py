"""``scripts.bench.model``: each round's batch is new prompts of the batch's shape, so vLLM's
prefix cache holds none of their blocks (every token is computed, as in a data-generation
run); a seed gives the same batch again."""

from __future__ import annotations

from scripts.bench.model import fresh_prompts


def test_fresh_batches_have_the_shape_asked_and_share_no_first_block() -> None:
    one, two = fresh_prompts(2, 6, 64), fresh_prompts(3, 6, 64)
    assert [len(p["prompt_token_ids"]) for p in one + two] == [64] * 12
    # the prefix cache matches whole blocks from a prompt's start: no two prompts may share
    # their first block (16 tokens, vLLM's smallest block here)
    firsts = {tuple(p["prompt_token_ids"][:16]) for p in one + two}
    assert len(firsts) == 12
    assert all(1 <= t < 1024 for p in one for t in p["prompt_token_ids"])
    assert fresh_prompts(2, 6, 64) == one  # a seed is a batch
