"""The producer's per-step metrics (``kv_connector.producer.step_stats``): each failure's
typed reason where it fails (the real ledgers), one step's data from a worker rank and from the
scheduler side, their merge over ranks, the API server's levels, and the form vLLM ships
them in (msgpack)."""

from __future__ import annotations

import msgspec

from kv_connector.producer.delivery import DeliveryBook
from kv_connector.producer.push.admission import ReaderAdmission, Router
from kv_connector.producer.step_stats import (
    Count,
    Level,
    LevelBook,
    Observed,
    SchedulerStats,
    StepStats,
    WorkerStats,
    empty,
    is_empty,
    merge,
    summary,
)
from kv_connector.sender.ledger import SendLedger
from kv_connector.sender.stats import SenderMetrics, SenderObservations, SenderStats
from kv_connector.wire import protocol
from kv_connector.wire.failure import FailureReason, SampleFailure
from tests.unit.sender.helpers import PAGE, POOL, grant, post, submit, to_writing


def refused(code: protocol.RefuseCode) -> SampleFailure:
    led = SendLedger(checksum=False)
    submit(led, "a")
    led.requests_due()
    led.on_refuse(protocol.Refuse(code=code, message="no", request_id="a"))
    return led.take_failed()["a"]


def test_every_failure_carries_its_reason_from_where_it_fails() -> None:
    led = SendLedger(checksum=False, connect_timeout_s=5.0, retry_backoff_s=0.0)
    submit(led, "late", t=0.0)
    led.expire(6.0, "[Errno 111] Connection refused", "10.0.0.1:7000")
    expired = led.take_failed()["late"]
    submit(led, "w", t=10.0)
    to_writing(led, "w", 10.0)
    for _ in range(2):
        assert led.write_failed("w", "NIXL_ERR_REMOTE", 10.0) is None
        assert len(led.writes_due(10.0)) == 1
        post(led, "w", 10.0)
    assert led.write_failed("w", "NIXL_ERR_REMOTE", 10.0) is not None
    write_failed = led.take_failed()["w"]
    hashing = SendLedger(checksum=True)
    submit(hashing, "d")
    assert hashing.checksum_failed("d", "MemoryError") is not None
    digest = hashing.take_failed()["d"]
    submit(led, "c")
    led.fail_all("sender closed: reset by peer")
    closed = led.take_failed()["c"]
    book = DeliveryBook(5.0, clock=lambda: 0.0)
    push = ReaderAdmission(book, ["10.0.0.1:7000"], 1, Router(["10.0.0.1:7000"]))
    book.add("r")
    push.links([("10.0.0.1:7000", 0, "[Errno 111] Connection refused")])
    push.admit("r")
    book.connect_timeout_s = 0.0
    admission = push.admit("r").failure
    timing = SendLedger(checksum=False)
    submit(timing, "t")
    timing.requests_due()
    timing.on_grant(grant("t"), PAGE, POOL, 1.0)
    timing.expire_granted(400.0, 300.0)
    deadline = timing.take_failed()["t"]
    submit(timing, "p")
    timing.freeze(["p"])
    preempted = timing.take_failed()["p"]
    bad_id = protocol.request_id_problem("a b")
    assert bad_id is not None
    book.add("x")
    book.refuse("x", bad_id)
    refused_id = push.admit("x").failure
    assert admission is not None and refused_id is not None

    cases = [
        (expired, FailureReason.UNREACHABLE),
        (admission, FailureReason.UNREACHABLE),
        (refused("checksum"), FailureReason.CHECKSUM),
        (refused("pool_too_small"), FailureReason.REFUSED),
        (refused("protocol"), FailureReason.REFUSED),
        (refused("write_failed"), FailureReason.WRITE_FAILED),  # another rank's WRITEs failed
        (write_failed, FailureReason.WRITE_FAILED),
        (digest, FailureReason.OTHER),
        (closed, FailureReason.OTHER),
        (deadline, FailureReason.TIMEOUT),
        (refused("timeout"), FailureReason.TIMEOUT),
        (preempted, FailureReason.PREEMPTED),
        (refused("preempted"), FailureReason.PREEMPTED),
        (refused("unchecked"), FailureReason.REFUSED),
        (refused("limit"), FailureReason.REFUSED),
        (refused_id, FailureReason.REQUEST_ID),
    ]
    assert [(f.why, f.reason) for f, _ in cases] == [(f.why, r) for f, r in cases]
    # the texts users read still name what happened
    assert expired.why.startswith("cannot reach") and write_failed.why.startswith("its WRITE failed")
    assert refused("checksum").why.startswith("reader refused (checksum)") and refused_id.why == bad_id


def test_the_sender_ledger_observes_each_completed_write_and_each_grant() -> None:
    led = SendLedger(checksum=False)
    submit(led, "a", t=1.0)
    led.requests_due()
    led.on_grant(grant("a"), PAGE, POOL, 1.25)  # 0.25 s after submission
    assert len(led.writes_due(1.25)) == 1
    post(led, "a", 2.0)
    led.write_completed("a", 3 * PAGE, 2.5)  # 0.5 s in flight
    assert led.take_observations() == SenderObservations([0.5], [0.25])
    assert led.take_observations() == SenderObservations([], [])
    assert (led.stats.writes, led.stats.bytes) == (1, 3 * PAGE)


def metrics(requests: int = 0, nbytes: int = 0, writes: int = 0, in_flight: int = 0) -> SenderMetrics:
    stats = SenderStats(requests=requests, bytes=nbytes, writes=writes, rewrites=writes // 2)
    return SenderMetrics(stats, SenderObservations([0.001] * writes, [0.01]), in_flight)


def test_rank_0_counts_samples_every_rank_counts_its_own_bytes() -> None:
    r0, r1 = WorkerStats(0), WorkerStats(1)
    for w in (r0, r1):
        w.shipped()
        w.shipped()
        w.failed(FailureReason.UNREACHABLE)
    d0 = r0.take([metrics(requests=1, nbytes=100, writes=2, in_flight=1)])
    d1 = r1.take([metrics(requests=1, nbytes=40, writes=2, in_flight=2)])
    assert d0 is not None and d1 is not None
    assert d0["counts"] == {"shipped": 2, "delivered": 1, "bytes_written": 100, "writes": 2, "rewrites": 1}
    assert d1["counts"] == {"bytes_written": 40, "writes": 2, "rewrites": 1}  # no samples on rank 1
    assert d0["failed"] == {"unreachable": 1} and d1["failed"] == {}
    both = merge(d0, d1)
    assert both["counts"]["bytes_written"] == 140 and both["counts"]["shipped"] == 2
    assert both["observed"]["write_latency_s"] == [0.001] * 4
    assert both["levels"] == {"samples_in_flight": {"rank0": 1, "rank1": 2}}
    assert d0["counts"]["bytes_written"] == 100  # merge changed neither input
    # the next step reports what changed since: the counters' deltas
    d0 = r0.take([metrics(requests=3, nbytes=250, writes=2, in_flight=1)])
    assert d0 is not None and d0["counts"] == {"delivered": 2, "bytes_written": 150}
    assert "samples_in_flight" not in d0["levels"]  # unchanged levels are not sent again
    assert r0.take([metrics(requests=3, nbytes=250, writes=2, in_flight=1)]) is not None  # observations
    assert WorkerStats(0).take([]) is None


def test_an_idle_step_takes_nothing_and_every_change_is_reported_once() -> None:
    led = SendLedger(checksum=False)
    w = WorkerStats(0)
    d = w.take_from([led])
    assert d is not None and d["levels"] == {"samples_in_flight": {"rank0": 0}}  # the first level
    assert w.take_from([led]) is None  # nothing happened since
    submit(led, "a", t=0.0)
    submit(led, "b", t=0.0)
    w.shipped()
    w.shipped()
    d = w.take_from([led])
    assert (
        d is not None and d["counts"] == {"shipped": 2} and d["levels"]["samples_in_flight"] == {"rank0": 2}
    )
    assert w.take_from([led]) is None
    led.requests_due()
    led.on_grant(grant("a"), PAGE, POOL, 0.5)  # only an observation changes
    d = w.take_from([led])
    assert d is not None and d["observed"] == {"credit_wait_s": [0.5]}
    # the same fingerprint as before that take drained "a"'s wait: the mark kept is the
    # one right after the take, so "b"'s wait is seen
    led.on_grant(grant("b", first=3), PAGE, POOL, 0.25)
    d = w.take_from([led])
    assert d is not None and d["observed"] == {"credit_wait_s": [0.25]}
    assert len(led.writes_due(1.0)) == 2
    post(led, "a", 1.0)
    led.write_completed("a", 3 * PAGE, 1.5)
    led.on_ack("a", 2.0)
    d = w.take_from([led])
    assert d is not None and d["counts"] == {"delivered": 1, "bytes_written": 3 * PAGE, "writes": 1}
    assert w.take_from([led]) is None


def test_a_step_with_nothing_new_is_none() -> None:
    s = StepStats("rank0")
    assert s.take() is None
    s.level(Level.SAMPLES_IN_FLIGHT, 0)
    want = {"counts": {}, "failed": {}, "observed": {}, "levels": {"samples_in_flight": {"rank0": 0}}}
    assert s.take() == want
    s.level(Level.SAMPLES_IN_FLIGHT, 0)
    s.count(Count.SHIPPED, 0)
    s.observe(Observed.WRITE_LATENCY, [])
    assert s.take() is None and is_empty(empty())


def test_the_scheduler_reports_its_book_and_admission_failures() -> None:
    s = SchedulerStats()
    s.waiting("a", True)
    s.waiting("b", True)
    s.waiting("a", True)  # asked again next step
    d = s.take(readers_reachable=0)
    assert d is not None and d["levels"] == {
        "readers_reachable": {"scheduler": 0},
        "requests_waiting_for_reader": {"scheduler": 2},
        "kv_blocks_held": {"scheduler": 0},
    }
    s.waiting("a", False)
    s.admission_failed(FailureReason.UNREACHABLE)
    s.waiting("b", False)
    s.holding("c", 3)
    s.holding("c", 3)  # request_finished once per request; counted once anyway
    s.holding("d", 2)
    d = s.take(readers_reachable=1)
    assert d is not None and d["failed"] == {"unreachable": 1}
    assert d["levels"]["kv_blocks_held"] == {"scheduler": 5}
    s.sent(["c", "unknown"])
    d = s.take(readers_reachable=1)
    assert d is not None and d["levels"] == {"kv_blocks_held": {"scheduler": 2}}
    assert s.take(readers_reachable=1) is None


def test_the_api_server_keeps_the_last_level_of_each_source() -> None:
    book = LevelBook()
    got = book.update({"samples_in_flight": {"rank0": 3, "rank1": 5}, "kv_blocks_held": {"scheduler": 7}})
    assert got == {Level.SAMPLES_IN_FLIGHT: 5, Level.KV_BLOCKS_HELD: 7}  # the slowest rank
    assert book.update({"samples_in_flight": {"rank1": 1}}) == {Level.SAMPLES_IN_FLIGHT: 3}
    assert book.update({"some_newer_level": {"x": 1}}) == {}


def test_step_data_crosses_msgpack_unchanged() -> None:
    w = WorkerStats(0)
    w.shipped()
    w.failed(FailureReason.CHECKSUM)
    d = w.take([metrics(requests=1, nbytes=10, writes=1, in_flight=0)])
    assert d is not None
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(d)) == d


def test_the_log_line_summarises_a_step() -> None:
    d = merge(
        {"counts": {"shipped": 3, "delivered": 2, "bytes_written": 5_000_000}, "failed": {"refused": 1}},
        {"observed": {"write_latency_s": [0.001, 0.003], "credit_wait_s": [0.5]}},
    )
    s = summary(d)
    assert (s["samples shipped"], s["delivered"], s["failed"], s["MB written"]) == (3, 2, 1, 5.0)
    assert s["WRITE ms avg"] == 2.0 and s["credit wait ms avg"] == 500.0


def test_samples_placed_in_credits_ahead_are_counted_as_deltas() -> None:
    w = WorkerStats(0)
    first = SenderMetrics(SenderStats(placed=3, credits=4), SenderObservations([], []), 0)
    second = SenderMetrics(SenderStats(placed=5, credits=6), SenderObservations([], []), 0)
    d1, d2 = w.take([first]), w.take([second])
    assert d1 is not None and d2 is not None
    assert d1["counts"]["placed_ahead"] == 3 and d2["counts"]["placed_ahead"] == 2
    assert summary(d2)["placed ahead"] == 2
