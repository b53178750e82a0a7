"""The model bench's raw arm (``scripts.bench.raw_connector``, the ceiling of ``a_over_a0``)
moves what it claims: every prompt's hidden states, as transformers computes them, land
in the raw target's pool once a round, a new batch's as well as the repeated one's, with
real vLLM and real NIXL between the engine's process and the bench's."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.bench.model import LAYER_IDS, ModelArm
from scripts.bench.raw_target import Landed
from tests.e2e.conftest import Reference, prompts_of, relative_error

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _check(landed: list[Landed], prompts: list[list[int]], arm: ModelArm, ref: Reference) -> None:
    assert arm.target is not None
    assert sorted(x.tokens for x in landed) == sorted(map(len, prompts))
    assert len({x.request_id for x in landed}) == len(prompts)
    by_length = {len(p): p for p in prompts}
    for x in landed:
        got = x.states(arm.target.pool)
        want = ref.states(by_length[x.tokens], LAYER_IDS)
        assert got.shape == want.shape
        assert relative_error(got, want) < 1e-4, (x.tokens, relative_error(got, want))


def test_the_raw_arm_lands_every_prompts_states(tmp_path: Path) -> None:
    from scripts.support.make_tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny-llama", "llama", seed=0)
    prompts = prompts_of([40, 64, 130], seed=3)  # distinct lengths: each landing names its prompt
    arm = ModelArm("ar", model, prompts, prompts_of([20], seed=4), True, 4096, False, raw=True)
    try:
        arm.ready()
        assert arm.target is not None
        before = len(arm.target.landed)
        run = arm.round(fresh=False)
        assert run.units == sum(map(len, prompts))
        _check(arm.target.landed[before:], prompts, arm, Reference(model))
        # a new batch each round (the bench's default): as many landings, the same shapes
        before = len(arm.target.landed)
        arm.round()
        fresh = arm.target.landed[before:]
        assert len(fresh) == len(prompts) and all(x.tokens == len(prompts[0]) for x in fresh)
    finally:
        arm.close()
