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

