"""A pipeline stage before the last (``producer.earlier_stage``): it ships nothing and
reports each shipped request's finish once, so that vLLM, which counts a finish from every
worker of every stage, frees the request's blocks when the last stage delivered. Pure
logic: the stages run on Model Runner V2 only, which vLLM's CPU build does not have."""

from __future__ import annotations

from kv_connector.producer.earlier_stage import EarlierStageWorker
from kv_connector.producer.planning import ShipOrder, StepPlan


def _ships(*rids: str) -> StepPlan:
    return StepPlan(ships=[ShipOrder(rid, (1, 2), (7,)) for rid in rids])


def test_a_shipped_request_is_reported_finished_once_when_the_scheduler_finishes_it() -> None:
    w = EarlierStageWorker(rank=1, stage=0, stages=2)
    w.wait_for_save(_ships("a", "b"))
    w.wait_for_save(None)
    assert w.get_finished(set()) is None
    assert w.get_finished({"a", "never-shipped"}) == {"a"}  # an aborted request: no one reports it
    assert w.get_finished({"a"}) is None  # once
    # a request that ships its output tokens ships in the step that finishes it: vLLM asks
    # for finished transfers before that step's wait_for_save
    assert w.get_finished({"c"}, shipping={"c"}) == {"c"}
    w.wait_for_save(_ships("c"))
    assert w.get_finished({"b", "c"}) == {"b"}  # c is not followed again: it was reported
    assert not w.build_connector_worker_meta() and w.get_kv_connector_stats() is None
    assert w.readers is None and w.wait_connected(0.0)


def test_vllms_aggregator_finishes_a_request_once_both_stages_reported_it() -> None:
    """vLLM's own ``KVOutputAggregator`` (one count a worker of the world: PP=2 x TP=1 is 2):
    the first stage's report alone finishes nothing; the last stage's delivery, steps later,
    finishes the request, once."""
    from copy import copy

    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    def out(finished: set[str] | None) -> object:
        o = copy(EMPTY_MODEL_RUNNER_OUTPUT)
        o.kv_connector_output = KVConnectorOutput(finished_sending=finished)
        return o

    agg = KVOutputAggregator(expected_finished_count=2)
    first = EarlierStageWorker(rank=0, stage=0, stages=2)
    first.wait_for_save(_ships("a", "b"))
    steps = [
        (first.get_finished({"a", "b"}), None),  # the scheduler finished both; none delivered yet
        (first.get_finished(set()), {"b"}),  # the last stage delivered b
        (first.get_finished(set()), None),
        (first.get_finished(set()), {"a"}),
    ]
    finished = [
        agg.aggregate([out(f0), out(f1)], output_rank=1).kv_connector_output.finished_sending
        for f0, f1 in steps
    ]
    assert finished == [None, {"b"}, None, {"a"}]
