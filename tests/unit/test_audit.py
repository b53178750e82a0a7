"""``kv_connector.audit``: next-token log-probabilities rebuilt from the last captured
layer agree with the model's own where the states are right, and not where they are the
layer before, shifted by a token, another prompt's, or zero."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kv_connector.audit import AuditError, LogprobAudit, audited, positions_of

LAYERS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scripts.support.make_tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny-llama", "llama", seed=0)


def forward(model_dir: Path, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The states [T, L+1, H] (ids 0..L, id L the last layer's output before the norm)
    and the model's own next-token log-probabilities [T, vocab]."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    last: list[torch.Tensor] = []
    hook = m.model.layers[-1].register_forward_hook(
        lambda mod, a, out: last.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        out = m(torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    hook.remove()
    states = torch.stack([*(out.hidden_states[k][0] for k in range(LAYERS)), last[0][0]], dim=1)
    return states, torch.log_softmax(out.logits[0].float(), dim=-1)


def reference(logprobs: torch.Tensor, tokens: list[int], positions: list[int]) -> dict[int, float]:
    return {p: float(logprobs[p - 1, tokens[p]]) for p in positions}


def test_right_states_agree_and_wrong_ones_do_not(model: Path) -> None:
    tokens = list(torch.randint(1, 1000, (40,), generator=torch.Generator().manual_seed(3)).tolist())
    other = list(torch.randint(1, 1000, (40,), generator=torch.Generator().manual_seed(4)).tolist())
    states, logprobs = forward(model, tokens)
    other_states, _ = forward(model, other)
    audit = LogprobAudit.from_model(model)
    layer_ids = [1, 2, LAYERS]
    positions = positions_of(len(tokens), 6, "row-7")
    ref = reference(logprobs, tokens, positions)
    tok = torch.tensor(tokens)

    def check(captured: torch.Tensor) -> float:
        return audit.check(tok, captured, layer_ids, ref).mean_error

    right = states[:, [1, 2, LAYERS]]
    ok = audit.check(tok, right, layer_ids, ref)
    assert ok.passed() and ok.mean_error < 1e-4 and ok.positions == tuple(positions)
    faults = {
        "the layer before": states[:, [1, 2, LAYERS - 1]],
        "shifted by a token": torch.roll(right, 1, dims=0),
        "another prompt's": other_states[:, [1, 2, LAYERS]],
        "the last layer zero": torch.cat([right[:, :2], torch.zeros_like(right[:, 2:])], dim=1),
    }
    for name, captured in faults.items():
        assert check(captured) > 0.1, name  # far above rounding (1e-4 and below)
        assert not audit.check(tok, captured, layer_ids, ref).passed(), name


def test_it_applies_only_where_the_last_capture_is_the_last_layer(model: Path) -> None:
    audit = LogprobAudit.from_model(model)
    assert audit.applies([1, 2, LAYERS]) and not audit.applies([1, 2, 3]) and not audit.applies([])
    with pytest.raises(AuditError, match="applies only there"):
        audit.check(torch.arange(5), torch.zeros(5, 3, 128), [1, 2, 3], {1: 0.0})
    with pytest.raises(AuditError, match="not prompt positions"):
        audit.check(torch.arange(5), torch.zeros(5, 3, 128), [1, 2, LAYERS], {0: 0.0})
    with pytest.raises(AuditError, match=r"config\.json"):
        LogprobAudit.from_model(model.parent / "nothing")


def test_rows_and_positions_are_chosen_the_same_everywhere() -> None:
    rows = [str(i) for i in range(20000)]
    share = sum(audited(r, 0.01) for r in rows) / len(rows)
    assert 0.005 < share < 0.015
    assert [audited(r, 0.01) for r in rows[:500]] == [audited(r, 0.01) for r in rows[:500]]
    assert all(audited(r, 1.0) for r in rows[:10]) and not any(audited(r, 0.0) for r in rows[:10])
    assert positions_of(40, 4, "a") == positions_of(40, 4, "a")
    assert positions_of(40, 4, "a")[-1] == 39 and len(positions_of(40, 4, "a")) == 4
    assert positions_of(1, 4, "a") == [] and positions_of(3, 10, "a") == [1, 2]
