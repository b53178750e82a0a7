"""Faults in what vLLM computes, injected into a real producer (``state_faults``): each
passes the integrity record (the connector ships faithfully what vLLM wrote) and is caught
by the check that sees it: the logprob audit (another layer, shifted, another request's
states), the reader's values screen (a layer all zeros), the slot check (a position not
written: a sample one row short) and the token check (a position computed from another
token than the sample's, in its prompt or its output). With the token check off the
token faults arrive: nothing else sees them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from kv_connector.audit import LogprobAudit
from kv_connector.reader import HiddenStatesReader, ReaderConfig, Sample
from scripts.support.deaths import explain
from tests.e2e.conftest import Reference, prompts_of, relative_error, start_producer
from tests.engines import EngineSpec, Run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CAPTURED = [1, 2, 3, 4]  # 4: the tiny Llama's last layer (what the audit rebuilds logprobs from)
FAULTS = ["none", "layer_before", "shift", "other", "zeros", "short", "input", "output"]
MARK = 1000  # a prompt's first token names its fault: MARK + its index in FAULTS
LENGTH = 90
TINY_MAX_ERROR = 1e-3  # the audit's threshold for the tiny random model (test_logprob_audit.py says why)


def _run(
    model: Path, faults: list[str], check_tokens: bool, check_values: bool = True
) -> tuple[dict[str, Sample], list[Any], str, Any]:
    prompts = prompts_of([LENGTH] * len(faults), seed=52)
    for i, name in enumerate(faults):
        prompts[i][0] = MARK + FAULTS.index(name)
    with HiddenStatesReader(ReaderConfig(check_values=check_values)) as reader:
        spec = EngineSpec.of(
            model, CAPTURED, {"check_tokens": check_tokens}, block_size=128, max_num_seqs=1,
            faults={MARK + FAULTS.index(f): f for f in faults},
        )  # fmt: skip
        run = Run(
            prompts, prompt_logprobs=0, max_tokens=[4 if f == "output" else 1 for f in faults],
            with_output=[i for i, f in enumerate(faults) if f == "output"],
            drain_steps=3,  # an in-process engine ships output tokens on a later step
        )  # fmt: skip
        proc = start_producer(spec, run, reader.address)
        got: dict[str, Sample] = {}
        try:
            while proc.poll() is None or len(got) < len(faults):
                try:
                    s = reader.get(timeout=3, copy=True)
                except TimeoutError:
                    if proc.poll() is not None:
                        break
                    continue
                got[s.request_id] = s
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, (explain(out + err, proc.returncode, "producer"), err[-3000:])
        stats = reader.stats()
    result = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    runs = list(zip(faults, prompts, result["outputs"], strict=True))
    return got, runs, out + err, stats


@pytest.mark.fresh_engine("faults injected into vLLM's own forward")
def test_faults_checksums_cannot_see_are_each_caught_by_their_check(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kv_connector")
    got, runs, log, stats = _run(tiny_llama, FAULTS, check_tokens=True)
    audit = LogprobAudit.from_model(tiny_llama)
    arrived = {f for f, _, o in runs if o["request_id"] in got}
    # every sample that arrived passed its integrity record; none failed one
    assert stats.refused_checksum == 0 and stats.checksum_mismatches == 0, stats
    assert arrived == {"none", "layer_before", "shift", "other"}, (arrived, log[-4000:])
    for fault, prompt, o in runs:
        rid = o["request_id"]
        if fault in arrived:
            s = got[rid]
            assert s.token_ids.tolist() == prompt
            ref = {p: o["prompt_logprobs"][p][str(prompt[p])] for p in range(1, len(prompt))}
            row = audit.check(s.token_ids, s.hidden_states, CAPTURED, ref)
            if fault == "none":
                assert row.passed(TINY_MAX_ERROR / 10), row
            else:
                assert not row.passed(TINY_MAX_ERROR), (fault, row)
    by_fault = {f: o["request_id"] for f, _, o in runs}
    bad = [r.getMessage() for r in caplog.records if "has bad states" in r.getMessage()]
    assert len(bad) == 1 and by_fault["zeros"] in bad[0] and "all zero" in bad[0], bad  # the values screen
    short = f"request {by_fault['short']}: token at position {LENGTH - 1} has no cache slot (-1)"
    assert short in log, log[-4000:]  # the slot check, at the producer
    for fault, position in (("input", 1), ("output", LENGTH)):
        why = f"request {by_fault[fault]} cannot be shipped: token check: 1 position(s) were computed"
        assert why in log and f"position {position} from" in log, (fault, log[-4000:])


@pytest.mark.fresh_engine("faults injected into vLLM's own forward")
def test_with_the_token_check_and_values_screen_off_their_faults_arrive(
    tiny_llama: Path, llama_reference: Reference
) -> None:
    """The samples arrive intact and say the tokens vLLM committed, while their states from
    the corrupted position on are those of other tokens (against transformers); with the
    values screen off too, the layer of zeros arrives."""
    got, runs, log, stats = _run(
        tiny_llama, ["none", "input", "output", "zeros"], check_tokens=False, check_values=False
    )
    assert "token check" not in log and "bad hidden states" not in log
    for fault, prompt, o in runs:
        if fault == "zeros":
            zeros = got[o["request_id"]].hidden_states
            assert not zeros[:, 1].any() and zeros[:, [0, 2, 3]].abs().sum(dim=-1).all()
            continue
        s = got[o["request_id"]]  # delivered, integrity intact, token ids as vLLM committed them
        want = prompt + o["output_token_ids"][:-1] if fault == "output" else prompt
        assert s.token_ids.tolist() == want, fault
        ref = llama_reference.states(want, CAPTURED)
        wrong_from = {"none": len(want), "input": 1, "output": LENGTH}[fault]
        assert relative_error(s.hidden_states[:wrong_from], ref[:wrong_from]) < 1e-4, fault
        if wrong_from < len(want):
            assert relative_error(s.hidden_states[wrong_from:], ref[wrong_from:]) > 1e-2, fault
    assert stats.refused_checksum == 0 and stats.checksum_mismatches == 0
