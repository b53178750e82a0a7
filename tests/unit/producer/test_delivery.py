"""The scheduler's delivery book and push's admission: admission while readers are
unreachable, the deadline, routing around down readers, and each finished request's
outcome."""

from __future__ import annotations

import pytest

from kv_connector.producer import modes
from kv_connector.producer.delivery import Admission, DeliveryBook
from kv_connector.producer.push.admission import ReaderAdmission, Router
from kv_connector.producer.worker_report import LinkChange, WorkerReport
from kv_connector.wire.failure import FailureReason, SampleFailure
from kv_connector.wire.outcome import SampleStatus


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def wf(why: str) -> SampleFailure:
    return SampleFailure(FailureReason.WRITE_FAILED, why)


R0, R1, R2 = (f"10.0.0.{i}:7000" for i in range(3))


class Push:
    """The book with push's admission over it, as the scheduler side holds them."""

    def __init__(self, book: DeliveryBook, admission: ReaderAdmission) -> None:
        self.book, self.admission = book, admission

    def update(
        self, links: list[tuple[str, int, str | None]], failures: dict[str, SampleFailure], done: list[str]
    ) -> list[tuple[str, SampleFailure]]:
        self.admission.links([LinkChange(*link) for link in links])
        return self.book.update(failures, done)

    def admit(self, request_id: str) -> Admission:
        return self.admission.admit(request_id)

    def started(self, request_id: str) -> str | None:
        return self.admission.started(request_id)

    def add(self, request_id: str) -> None:
        self.book.add(request_id)

    def refuse(self, request_id: str, why: str) -> None:
        self.book.refuse(request_id, why)

    def outcome(self, request_id: str) -> tuple[SampleStatus, str]:
        return self.book.outcome(request_id)

    def finish(self, request_id: str) -> None:
        self.book.finish(request_id)

    def __len__(self) -> int:
        return len(self.book)


def book(readers: int = 1, world: int = 1, policy: str = "request_hash") -> tuple[Push, Clock]:
    clock = Clock()
    addrs = [R0, R1, R2][:readers]
    b = DeliveryBook(5.0, clock=clock)
    return Push(b, ReaderAdmission(b, addrs, world, Router(addrs, policy))), clock


def test_a_request_waits_for_its_reader_then_runs_once_every_rank_is_connected() -> None:
    b, clock = book(world=2)
    b.add("r")
    assert b.admit("r").kind == "wait"  # nothing reported yet
    b.update([(R0, 0, None)], {}, [])
    clock.t += 1
    assert b.admit("r").kind == "wait"  # rank 1 not connected yet
    b.update([(R0, 1, None)], {}, [])
    a = b.admit("r")
    assert (a.kind, a.reader) == ("run", R0)
    # admitted once: runs even if the link drops later (e.g. recomputed after preemption)
    b.update([(R0, 1, "lost the connection: reset")], {}, [])
    assert b.admit("r").kind == "run"


def test_a_request_that_waited_past_the_deadline_fails_with_the_last_error() -> None:
    b, clock = book()
    b.add("r")
    b.update([(R0, 0, "[Errno 111] Connection refused")], {}, [])
    assert b.admit("r").kind == "wait"
    clock.t += 4.9
    assert b.admit("r").kind == "wait"
    clock.t += 0.2
    a = b.admit("r")
    assert a.kind == "fail"
    assert "10.0.0.0:7000" in a.why and "Connection refused" in a.why and "5 s" in a.why
    assert b.outcome("r") == (SampleStatus.FAILED, a.why)
    assert b.admit("r").kind == "fail"  # asked again (e.g. skipped a step): the same answer
    b.finish("r")
    assert len(b) == 0 and b.outcome("r") == (SampleStatus.PENDING, "")


def test_outcomes_follow_the_workers_reports_and_late_failures_are_returned() -> None:
    b, _ = book()
    b.update([(R0, 0, None)], {}, [])
    for rid in ("ok", "bad", "slow"):
        b.add(rid)
        assert b.admit(rid).kind == "run"
    late = b.update([], {"bad": wf("WRITE failed"), "gone": wf("deadline")}, ["ok", "unknown"])
    assert late == [("gone", wf("deadline"))]
    assert b.outcome("ok") == (SampleStatus.DELIVERED, "")
    assert b.outcome("bad") == (SampleStatus.FAILED, "WRITE failed")
    assert b.outcome("slow") == (SampleStatus.PENDING, "")
    for rid in ("ok", "bad", "slow"):
        b.finish(rid)
    assert b.update([], {"slow": wf("deadline")}, []) == [("slow", wf("deadline"))]
    assert len(b) == 0


def test_request_hash_waits_for_its_own_reader_and_round_robin_skips_down_readers() -> None:
    b, clock = book(readers=2)
    b.update([(R0, 0, None), (R1, 0, "refused")], {}, [])
    ids = [f"req-{i}" for i in range(40)]
    for rid in ids:
        b.add(rid)
    kinds = {rid: b.admit(rid) for rid in ids}
    router = Router([R0, R1])
    for rid, a in kinds.items():
        if router.route(rid) == R0:
            assert (a.kind, a.reader) == ("run", R0)
        else:
            assert a.kind == "wait"
    clock.t += 6
    failed = [rid for rid in ids if b.admit(rid).kind == "fail"]
    assert failed and all(router.route(r) == R1 for r in failed)
    assert "10.0.0.1:7000" in b.outcome(failed[0])[1]

    rr, clock = book(readers=3, policy="round_robin")
    rr.update([(R0, 0, None), (R1, 0, "refused"), (R2, 0, None)], {}, [])
    got = []
    for i in range(6):
        rr.add(f"q{i}")
        got.append(rr.admit(f"q{i}").reader)
    assert got == [R0, R2, R0, R2, R0, R2]
    rr.update([(R0, 0, "reset"), (R2, 0, "reset")], {}, [])
    rr.add("late")
    assert rr.admit("late").kind == "wait"
    clock.t += 6
    a = rr.admit("late")
    assert a.kind == "fail" and "any reader" in a.why


def test_reports_for_unknown_readers_or_ranks_are_ignored() -> None:
    b, _ = book(readers=1, world=1)
    b.update([("10.9.9.9:1", 0, None), (R0, 9, None)], {}, [])
    b.add("r")
    assert b.admit("r").kind == "wait"


def test_a_request_not_added_is_admitted_but_leaves_no_state() -> None:
    b, _ = book()
    b.update([(R0, 0, None)], {}, [])
    assert b.admit("stranger").kind == "run"
    assert b.update([], {"stranger": wf("x")}, []) == [("stranger", wf("x"))]


@pytest.mark.parametrize("world", [0, -1])
def test_bad_world_size_is_refused(world: int) -> None:
    with pytest.raises(ValueError):
        ReaderAdmission(DeliveryBook(1.0), ["a:1"], world, Router(["a:1"]))


def test_a_request_refused_for_its_id_fails_at_admission_alone_whatever_the_links() -> None:
    from types import SimpleNamespace

    from kv_connector.producer.options import ConnectorOptions
    from kv_connector.producer.scheduler_side import SchedulerSide

    options = ConnectorOptions.parse({"consumer_address": "10.0.0.1:7000"})
    side = SchedulerSide(options, None, "p", make_mode=modes.scheduler_mode)
    report = WorkerReport(links=[LinkChange("10.0.0.1:7000", 0, None)])
    output = SimpleNamespace(kv_connector_worker_meta=SimpleNamespace(report=report), finished_sending=None)
    side.update_connector_output(output)  # type: ignore[arg-type]
    bad = SimpleNamespace(request_id="a b/c", kv_transfer_params=None, all_token_ids=[1, 2, 3])
    good = SimpleNamespace(request_id="cmpl-1-0-ab12", kv_transfer_params=None, all_token_ids=[1, 2, 3])
    for r in (bad, good):
        side.on_new_request(r)  # type: ignore[arg-type]
        assert side.get_num_new_matched_tokens(r, 0) == (0, False)  # type: ignore[arg-type]  # both run; only one ships
    assert not side.planner.is_tracked("a b/c") and side.planner.is_tracked("cmpl-1-0-ab12")
    hold, params = side.request_finished(bad, [1, 2])  # type: ignore[arg-type]
    assert not hold and params is not None
    assert params["hidden_states"]["status"] == "failed"
    assert "cannot name a sample" in params["hidden_states"]["error"]


@pytest.mark.parametrize("sharding", ["request_hash", "round_robin"])
def test_a_request_that_failed_admission_names_its_own_reader_or_none(sharding: str) -> None:
    from types import SimpleNamespace

    from kv_connector.producer.options import ConnectorOptions
    from kv_connector.producer.scheduler_side import SchedulerSide

    addrs = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]
    options = ConnectorOptions.parse({"consumer_address": addrs, "sharding": sharding})
    side = SchedulerSide(options, None, "p", make_mode=modes.scheduler_mode)
    for rid in ("bad id 1", "bad id 2", "bad id 3", "bad id 4"):
        r = SimpleNamespace(request_id=rid, kv_transfer_params=None, all_token_ids=[1])
        side.on_new_request(r)  # type: ignore[arg-type]
        side.get_num_new_matched_tokens(r, 0)  # type: ignore[arg-type]
        _, params = side.request_finished(r, [])  # type: ignore[arg-type]
        assert params is not None
        got = params["hidden_states"]["consumer_address"]
        if sharding == "request_hash":
            assert got == Router(addrs).route(rid)  # not always the first reader
        else:
            assert got is None


def test_the_outcome_record_is_the_same_at_both_ends() -> None:
    from kv_connector.wire.outcome import OutcomeError, SampleOutcome

    failed = SampleOutcome(SampleStatus.FAILED, "p", "r", "7", None, error="cannot reach")
    assert failed.params() == {
        "hidden_states": {
            "status": "failed", "producer_id": "p", "request_id": "r", "sample_id": "7",
            "consumer_address": None, "error": "cannot reach",
        }
    }  # fmt: skip
    delivered = SampleOutcome(SampleStatus.DELIVERED, "p", "r", "r", "127.0.0.1:5555")
    assert "error" not in delivered.params()["hidden_states"]
    for o in (failed, delivered):
        assert SampleOutcome.of(o.params()) == o
    newer = {"hidden_states": {**delivered.params()["hidden_states"], "added_later": 1}}
    assert SampleOutcome.of(newer) == delivered
    for bad in (None, {}, {"hidden_states": "x"}, {"hidden_states": {"status": "lost"}}):
        with pytest.raises(OutcomeError):
            SampleOutcome.of(bad)


def test_a_request_vllm_started_without_admitting_it_is_bound_to_its_reader_then() -> None:
    """vLLM runs requests that skip the prefix cache (prompt_logprobs) even while the
    connector says "not yet": such a request is bound when it is first scheduled."""
    b, _ = book(readers=2)
    b.add("early")
    assert b.admit("early").kind == "wait"  # no reader reported yet
    reader = b.started("early")  # scheduled anyway
    assert reader == Router([R0, R1]).route("early")  # where request_hash sends it, up or not
    a = b.admit("early")
    assert (a.kind, a.reader) == ("run", reader)
    assert b.started("early") is None  # bound once
    b.update([(R0, 0, None), (R1, 0, None)], {}, [])
    b.add("normal")
    assert b.admit("normal").kind == "run"
    assert b.started("normal") is None  # admitted the usual way: nothing to do
    b.add("bad")
    b.refuse("bad", "its request id cannot travel")
    assert b.started("bad") is None and b.outcome("bad")[0] is SampleStatus.FAILED
