"""The sender's job ledger as a state machine: every transition, every illegal one, and
the invariants S1-S8 of ``kv_connector.sender.ledger`` (each test names the one it proves).
Pure: no transport, no sockets, no threads; times are passed in."""

from __future__ import annotations

import pathlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_connector.sender as wing
from kv_connector.sender.job_states import IllegalJobTransition, JobState
from kv_connector.sender.jobs import ChecksumState, FrozenJob
from kv_connector.sender.stats import SenderObservations
from kv_connector.wire import protocol
from kv_connector.wire.failure import FailureReason, SampleFailure
from kv_connector.wire.layout import stripe
from kv_connector.wire.protocol import ProtocolError
from tests.unit.sender.helpers import (
    PAGE,
    POOL,
    grant,
    ledger,
    manifest,
    post,
    submit,
    to_granted,
    to_writing,
)


# ------------------------------------------------------------- the happy path
def test_a_job_goes_waiting_requested_granted_writing_written_finished() -> None:
    led = ledger()
    submit(led, "a")
    assert led.state_of("a") is JobState.WAITING
    assert [j.request_id for j in led.requests_due()] == ["a"]
    assert led.state_of("a") is JobState.REQUESTED and led.requests_due() == []
    led.on_grant(grant("a"), PAGE, POOL, 1.0)
    assert led.state_of("a") is JobState.GRANTED
    (job,) = led.writes_due(1.0)
    post(led, "a", 1.0, "xfer")
    assert led.state_of("a") is JobState.WRITING and led.writing and job.xfer == "xfer"
    assert led.writes_due(1.0) == []  # S4: one WRITE in flight
    led.write_completed("a", 3 * PAGE, 1.5)
    assert led.state_of("a") is JobState.WRITTEN and led.unwritten == 0
    assert led.on_ack("a", 2.0)
    assert "a" not in led and led.take_finished() == ["a"] and led.take_finished() == []
    st_ = led.stats
    assert (st_.requests, st_.bytes, st_.write_s, st_.grant_wait_s) == (1, 3 * PAGE, 0.5, 1.0)


def test_s1_a_finished_or_failed_job_is_reported_once_with_its_reason() -> None:
    led = ledger()
    for rid in "abc":
        submit(led, rid)
    led.requests_due()
    led.on_refuse(protocol.Refuse(code="pool_too_small", message="too big", request_id="b"))
    assert led.take_failed() == {
        "b": SampleFailure(FailureReason.REFUSED, "reader refused (pool_too_small): too big")
    }
    assert led.take_failed() == {}
    assert [f.request_id for f in led.fail_all("closing")] == ["a", "c"]
    closing = SampleFailure(FailureReason.OTHER, "closing")
    assert led.take_failed() == {"a": closing, "c": closing} and len(led) == 0


def test_submitting_a_request_twice_is_refused() -> None:
    led = ledger()
    submit(led, "a")
    with pytest.raises(ValueError, match="already being shipped"):
        submit(led, "a")


# ------------------------------------------------------------------- grants
def test_s2_no_write_without_a_grant_of_the_current_connection() -> None:
    led = ledger()
    submit(led, "a")
    assert led.writes_due(0.0) == []
    with pytest.raises(IllegalJobTransition, match="waiting"):
        post(led, "a", 0.0)
    led.requests_due()
    with pytest.raises(IllegalJobTransition):
        post(led, "a", 0.0)
    led.on_grant(grant("a"), PAGE, POOL, 1.0)
    assert led.connection_lost(2.0) == (1, [])
    job = led.job("a")
    assert (job.state, job.grant) == (JobState.WAITING, None)
    assert led.writes_due(3.0) == []
    with pytest.raises(IllegalJobTransition):
        post(led, "a", 3.0)


@pytest.mark.parametrize(
    "g, match",
    [
        (grant("other"), "not waiting"),
        (grant("a", 2), "does not fit"),
        (grant("a", 4), "does not fit"),
        (grant("a", 3, first=62), "outside the reader's pool"),
    ],
)
def test_a_grant_that_does_not_fit_is_the_readers_protocol_error(g: protocol.Grant, match: str) -> None:
    led = ledger()
    submit(led, "a")
    led.requests_due()
    with pytest.raises(ProtocolError, match=match):
        led.on_grant(g, PAGE, POOL, 1.0)
    assert led.state_of("a") is JobState.REQUESTED


@pytest.mark.parametrize("state", ["waiting", "granted", "writing", "written"])
def test_a_grant_in_any_state_but_requested_is_refused(state: str) -> None:
    led = ledger()
    submit(led, "a")
    if state != "waiting":
        to_granted(led, "a")
    if state in ("writing", "written"):
        led.writes_due(1.0)
        post(led, "a", 1.0)
    if state == "written":
        led.write_completed("a", PAGE, 1.0)
    with pytest.raises(ProtocolError, match="not waiting"):
        led.on_grant(grant("a"), PAGE, POOL, 1.0)


def test_pages_smaller_than_a_block_make_a_longer_run() -> None:
    led = ledger()
    submit(led, "a")
    led.requests_due()
    page = PAGE // 2 + 64  # 3 blocks of 2 pages each, less a bit
    g = protocol.Grant(request_id="a", first_page=0, num_pages=-(-3 * PAGE // page), generation=1)
    led.on_grant(g, page, POOL, 1.0)
    assert led.state_of("a") is JobState.GRANTED


# ------------------------------------------------------------- write failures
def test_a_failed_write_is_posted_again_after_a_backoff_then_the_job_fails() -> None:
    led = ledger()
    submit(led, "a")
    to_writing(led, "a", 1.0)
    assert led.write_failed("a", "NIXL_ERR_REMOTE", 1.0) is None
    assert led.state_of("a") is JobState.GRANTED
    assert led.writes_due(1.1) == []  # backoff 0.2 s
    assert [j.request_id for j in led.writes_due(1.2)] == ["a"]
    post(led, "a", 1.2)
    assert led.write_failed("a", "NIXL_ERR_REMOTE", 1.2) is None
    assert led.writes_due(1.5) == [] and len(led.writes_due(1.6)) == 1  # backoff 0.4 s
    post(led, "a", 1.6)
    failure = led.write_failed("a", "NIXL_ERR_NOT_FOUND", 1.6)
    assert failure is not None and failure.tell_reader
    assert failure.why == "its WRITE failed in NIXL 3 times (last: NIXL_ERR_NOT_FOUND)"
    assert (
        led.take_failed() == {"a": SampleFailure(FailureReason.WRITE_FAILED, failure.why)}
        and led.stats.write_retries == 2
    )


@pytest.mark.parametrize("state", ["waiting", "requested", "granted", "written"])
def test_write_completion_or_failure_outside_writing_is_illegal(state: str) -> None:
    led = ledger()
    submit(led, "a")
    if state == "requested":
        led.requests_due()
    if state == "granted":
        to_granted(led, "a")
    if state == "written":
        to_writing(led, "a")
        led.write_completed("a", PAGE, 1.0)
    with pytest.raises(IllegalJobTransition):
        led.write_completed("a", PAGE, 2.0)
    with pytest.raises(IllegalJobTransition):
        led.write_failed("a", "x", 2.0)
    with pytest.raises(IllegalJobTransition, match="not in flight"):
        led.write_completed("nobody", PAGE, 2.0)


# ---------------------------------------------------------------- rewrites
def test_a_rewrite_of_a_written_share_makes_it_due_again() -> None:
    led = ledger()
    submit(led, "a")
    to_writing(led, "a")
    led.write_completed("a", PAGE, 1.0)
    assert led.on_rewrite(protocol.Rewrite(request_id="a"))
    assert led.state_of("a") is JobState.GRANTED and len(led.writes_due(2.0)) == 1
    assert led.stats.rewrites == 1


def test_s4_a_rewrite_while_the_write_is_in_flight_is_honoured_when_it_completes() -> None:
    led = ledger()
    submit(led, "a")
    to_writing(led, "a")
    assert led.on_rewrite(protocol.Rewrite(request_id="a"))
    assert led.state_of("a") is JobState.WRITING  # still one WRITE in flight
    led.write_completed("a", PAGE, 1.5)
    assert led.state_of("a") is JobState.GRANTED and len(led.writes_due(2.0)) == 1


def test_a_rewrite_of_a_granted_share_changes_nothing() -> None:
    led = ledger()
    submit(led, "a")
    to_granted(led, "a")
    assert not led.on_rewrite(protocol.Rewrite(request_id="a"))
    assert led.state_of("a") is JobState.GRANTED


@pytest.mark.parametrize("state", ["unknown", "waiting", "requested", "empty-share"])
def test_a_rewrite_of_a_share_never_granted_is_the_readers_protocol_error(state: str) -> None:
    led = ledger()
    if state == "empty-share":
        submit(led, "a", n=5, rank=1, world=2)  # one block: rank 1 has none of it
        to_granted(led, "a", pages=1)
    elif state != "unknown":
        submit(led, "a")
        if state == "requested":
            led.requests_due()
    with pytest.raises(ProtocolError, match="not granted"):
        led.on_rewrite(protocol.Rewrite(request_id="a"))


# --------------------------------------------------------------------- acks
def test_s3_an_ack_that_overtakes_the_writes_completion_finishes_the_job_when_it_completes() -> None:
    led = ledger()
    submit(led, "a")
    to_writing(led, "a")
    assert led.on_ack("a", 1.2)  # the reader has it: its notification came before our poll
    assert "a" in led and led.take_finished() == []
    led.write_completed("a", PAGE, 1.3)
    assert led.take_finished() == ["a"] and "a" not in led


def test_s3_an_ack_for_a_resend_the_reader_already_has_finishes_a_requested_job() -> None:
    led = ledger()
    submit(led, "a")
    led.requests_due()
    assert led.on_ack("a", 1.0)
    assert led.take_finished() == ["a"]


def test_an_ack_for_a_job_not_in_flight_is_ignored() -> None:
    led = ledger()
    assert not led.on_ack("ghost", 1.0)
    assert led.take_finished() == []


def test_a_connection_lost_after_an_early_ack_finishes_the_job_instead_of_resending_it() -> None:
    led = ledger()
    submit(led, "a")
    submit(led, "b")
    to_writing(led, "a")
    led.on_ack("a", 1.0)
    assert led.connection_lost(2.0) == (1, [])  # only b is resent
    assert led.take_finished() == ["a"] and led.state_of("b") is JobState.WAITING


# ----------------------------------------------------------------- refusals
def test_a_refusal_of_the_whole_connection_is_a_protocol_error() -> None:
    led = ledger()
    submit(led, "a")
    with pytest.raises(ProtocolError, match="refused the connection"):
        led.on_refuse(protocol.Refuse(code="protocol", message="bad"))
    # a refusal of a request no longer here (it ended meanwhile: S9) is moot
    assert led.on_refuse(protocol.Refuse(code="checksum", message="?", request_id="not-ours")) is None
    assert "a" in led


def test_a_refused_request_fails_without_telling_the_reader_again() -> None:
    led = ledger()
    submit(led, "a")
    led.requests_due()
    f = led.on_refuse(protocol.Refuse(code="checksum", message="failed 4 times", request_id="a"))
    assert f is not None and not f.tell_reader and f.why == "reader refused (checksum): failed 4 times"
    assert f.generation is None  # never granted: no pages of the reader's to fence


def test_s9_a_job_refused_with_its_write_in_flight_hands_the_shell_its_handle_and_grant() -> None:
    """The shell polls the WRITE to its end, then sends the grant's fence: only then may
    the reader give those pages to another sample."""
    led = ledger()
    submit(led, "a")
    submit(led, "b")
    to_writing(led, "a")
    to_granted(led, "b")
    (xfer,) = [j.xfer for j in led.writes_in_flight()]
    f = led.on_refuse(protocol.Refuse(code="timeout", message="late", request_id="a"))
    assert f is not None and f.xfer is xfer and f.generation == 5 and not f.tell_reader
    g = led.fail("b", "its checksum failed", FailureReason.OTHER)  # failed here, granted, no WRITE
    assert g is not None and g.xfer is None and g.generation == 5 and g.tell_reader


def test_s9_a_job_failed_while_its_write_is_being_posted_is_fenced_by_its_poster() -> None:
    led = ledger()
    submit(led, "a")
    to_granted(led, "a")
    led.write_posting("a", 1.0, led.notification("a"))  # the transport not called yet
    f = led.fail("a", "preempted", FailureReason.PREEMPTED, code="preempted")
    assert f is not None and f.xfer is None and f.generation is None  # the poster fences it
    assert led.write_started("a", object()) is False


def test_s2_every_write_names_the_grant_it_writes_into() -> None:
    led = ledger()
    submit(led, "a")
    led.requests_due()
    led.on_grant(grant("a", generation=42), PAGE, POOL, 1.0)
    assert len(led.writes_due(1.0)) == 1
    assert post(led, "a", 1.0).generation == 42


# ---------------------------------------------------------------- deadlines
def test_s5_a_job_waits_for_a_working_reader_at_most_connect_timeout() -> None:
    led = ledger(timeout=10.0)
    submit(led, "a", t=0.0)
    submit(led, "b", t=5.0)
    assert led.expire(9.0, "refused", "h:1") == []
    (f,) = led.expire(10.5, "[Errno 111] Connection refused", "h:1")
    assert f.request_id == "a" and not f.tell_reader
    assert f.why == "cannot reach the reader at h:1 for 10 s (last error: [Errno 111] Connection refused)"
    assert "b" in led


def test_s5_every_answer_of_the_reader_starts_the_wait_again() -> None:
    led = ledger(timeout=10.0)
    submit(led, "a", t=0.0)
    submit(led, "b", t=0.0)
    to_writing(led, "a", 8.0)  # the grant of a is an answer: b waits again too
    assert led.expire(15.0, "x", "h:1") == []
    led.write_completed("a", PAGE, 17.0)  # a's own progress
    assert {f.request_id for f in led.expire(18.5, "x", "h:1")} == {"b"}
    assert led.expire(26.0, "x", "h:1") == []
    assert {f.request_id for f in led.expire(27.5, "x", "h:1")} == {"a"}


def test_a_job_that_expires_after_its_credit_request_tells_the_reader() -> None:
    led = ledger(timeout=1.0)
    submit(led, "a", t=0.0)
    led.requests_due()
    (f,) = led.expire(2.0, "silent", "h:1")
    assert f.tell_reader  # the reader holds its credit request


# ------------------------------------------------------------------ checksums
def test_s6_a_write_never_waits_for_its_checksum_which_follows_once() -> None:
    led = ledger(checksum=True)
    submit(led, "a")
    assert led.job("a").checksum_state is ChecksumState.NEEDED
    led.requests_due()
    (job,) = led.checksums_due()
    assert job.checksum_state is ChecksumState.COMPUTING and led.checksums_due() == []
    led.on_grant(grant("a"), PAGE, POOL, 1.0)
    assert len(led.writes_due(1.0)) == 1  # not held back by the checksum
    notif = post(led, "a", 1.0)
    assert notif == protocol.WriteDone(request_id="a", generation=5, checksum_follows=True)
    assert led.checksums_owed() == []  # not computed yet
    led.checksum_ready("a", 1234)
    assert [j.checksum for j in led.checksums_owed()] == [1234]
    assert led.checksums_owed() == []  # sent once


def test_s6_a_checksum_ready_before_the_write_rides_with_it() -> None:
    led = ledger(checksum=True)
    submit(led, "a")
    led.requests_due()
    led.checksums_due()
    led.checksum_ready("a", 77)
    led.on_grant(grant("a"), PAGE, POOL, 1.0)
    assert post(led, "a", 1.0) == protocol.WriteDone(request_id="a", generation=5, checksum=77)
    assert led.checksums_owed() == []


def test_s6_a_checksum_owed_on_a_lost_connection_is_not_sent_on_the_next() -> None:
    led = ledger(checksum=True)
    submit(led, "a")
    to_writing(led, "a")
    led.checksums_due()
    led.connection_lost(2.0)
    led.checksum_ready("a", 9)
    assert led.checksums_owed() == []  # the resend's WRITE will carry it


def test_without_checksums_a_write_announces_no_checksum() -> None:
    led = ledger(checksum=False)
    submit(led, "a")
    to_granted(led, "a")
    assert post(led, "a", 1.0) == protocol.WriteDone(request_id="a", generation=5)


def test_s6_a_checksum_that_cannot_be_computed_fails_the_job() -> None:
    led = ledger(checksum=True)
    submit(led, "a")
    led.requests_due()
    led.checksums_due()
    f = led.checksum_failed("a", "RuntimeError: CUDA error")
    assert f is not None and f.tell_reader and "cannot checksum its blocks" in f.why
    assert led.checksum_failed("a", "again") is None  # already gone


def test_a_checksum_nobody_asked_for_is_illegal() -> None:
    led = ledger(checksum=True)
    submit(led, "a")
    with pytest.raises(IllegalJobTransition):
        led.checksum_ready("a", 1)  # not started
    led.checksum_ready("gone", 1)  # a job that failed meanwhile: ignored


def test_a_checksum_is_computed_once_across_reconnects() -> None:
    led = ledger(checksum=True)
    submit(led, "a")
    led.requests_due()
    led.checksums_due()
    led.checksum_ready("a", 7)
    led.connection_lost(1.0)
    led.requests_due()
    assert led.checksums_due() == [] and led.job("a").checksum == 7


def test_an_empty_share_is_written_at_once_and_needs_no_checksum() -> None:
    led = ledger(checksum=True)
    submit(led, "a", n=5, rank=1, world=2)
    assert led.job("a").checksum_state is ChecksumState.OFF
    to_granted(led, "a", pages=1)
    assert led.writes_due(1.0) == [] and led.state_of("a") is JobState.WRITTEN


# ------------------------------------------------------------- deadline (S7)
def test_s7_a_granted_job_not_acknowledged_in_time_fails_and_the_reader_is_told() -> None:
    led = ledger()
    submit(led, "a")
    submit(led, "b")
    to_granted(led, "a", t=1.0)
    led.on_grant(grant("b"), PAGE, POOL, 5.0)
    assert led.expire_granted(5.0, 10.0) == []
    (f,) = led.expire_granted(11.5, 10.0)  # a: granted at 1, b only at 5
    assert f.request_id == "a" and f.tell_reader and f.code == "timeout"
    assert "a" in led.take_failed() and "b" in led


def test_s7_the_deadline_waits_for_a_write_in_flight_and_ignores_jobs_not_granted() -> None:
    led = ledger()
    submit(led, "a")
    submit(led, "b")  # never granted: its wait is connect_timeout_s's business (S5)
    to_writing(led, "a", t=1.0)
    led.job("b").state = JobState.REQUESTED
    assert led.expire_granted(100.0, 10.0) == []  # a's WRITE still holds a transport handle
    led.write_completed("a", PAGE, 100.0)
    assert [f.request_id for f in led.expire_granted(100.0, 10.0)] == ["a"]


# ----------------------------------------------------------- preemption (S8)
def test_s8_jobs_not_safely_written_are_the_ones_a_preemption_waits_for() -> None:
    led = ledger(checksum=True)
    for rid in "abcd":
        submit(led, rid)
    led.checksums_due()
    for rid in "bcd":
        led.checksum_ready(rid, 7)
    to_writing(led, "b")
    led.write_completed("b", PAGE, 1.5)  # b: written, hashed: safe
    for k, rid in enumerate("acd"):
        led.on_grant(grant(rid, first=3 * (k + 1)), PAGE, POOL, 1.5)
    post(led, "c", 1.5)  # c: WRITE in flight; d: granted, not posted
    assert led.unsafe(["a", "b", "c", "d", "nobody"]) == ["a", "c", "d"]


def test_s8_freezing_fails_what_is_not_safely_written_and_tells_the_reader() -> None:
    led = ledger()
    submit(led, "b")
    submit(led, "c")
    to_granted(led, "b")  # granted, WRITE not posted
    handle = object()
    led.on_grant(grant("c", first=3), PAGE, POOL, 1.0)
    post(led, "c", 1.0, handle)  # c's WRITE in flight
    submit(led, "a")  # WAITING: its credit request has not gone out
    failures = led.freeze(["a", "b", "c", "unknown"])
    by_id = {f.request_id: f for f in failures}
    assert set(by_id) == {"a", "b", "c"} and all(f.code == "preempted" for f in failures)
    assert by_id["b"].tell_reader and not by_id["a"].tell_reader  # a's request never went out
    assert by_id["c"].xfer is handle and by_id["b"].xfer is None  # the shell settles c's WRITE
    assert len(led) == 0 and set(led.take_failed()) == {"a", "b", "c"}


def test_s8_a_frozen_job_that_was_written_lives_but_is_never_written_again() -> None:
    led = ledger(checksum=True)
    submit(led, "a")
    led.checksums_due()
    led.checksum_ready("a", 7)
    to_writing(led, "a")
    led.write_completed("a", PAGE, 2.0)
    assert led.freeze(["a"]) == []
    with pytest.raises(FrozenJob):  # a Rewrite would read the reused blocks
        led.on_rewrite(protocol.Rewrite(request_id="a"))
    led.on_ack("a", 3.0)
    assert led.take_finished() == ["a"]


def test_s8_a_written_job_whose_checksum_was_not_taken_is_not_safe() -> None:
    led = ledger(checksum=True)
    submit(led, "a")
    led.checksums_due()  # COMPUTING: the hash would read the reused blocks
    to_writing(led, "a")
    led.write_completed("a", PAGE, 2.0)
    (f,) = led.freeze(["a"])
    assert f.code == "preempted" and f.tell_reader
    led.checksum_ready("a", 7)  # the late checksum is dropped
    assert "a" not in led


def test_s8_a_frozen_job_is_not_resent_after_the_connection_is_lost() -> None:
    led = ledger()
    submit(led, "a")
    submit(led, "b")
    to_writing(led, "a")
    led.write_completed("a", PAGE, 1.5)
    assert led.freeze(["a"]) == []
    resend, failures = led.connection_lost(2.0)
    assert resend == 1 and [f.request_id for f in failures] == ["a"]
    assert not failures[0].tell_reader  # there is no reader to tell on this connection


# ------------------------------------------------------------------ queries
def test_unwritten_counts_what_has_not_landed() -> None:
    led = ledger()
    for rid in "abc":
        submit(led, rid)
    to_writing(led, "a")
    led.write_completed("a", PAGE, 1.0)
    assert led.unwritten == 2


# ------------------------------------------------- random event sequences (S1)
EVENTS = [
    "request",
    "grant",
    "post",
    "complete",
    "fail_write",
    "rewrite",
    "ack",
    "lose",
    "expire",
    "deadline",
    "preempt",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(EVENTS), st.sampled_from("abc")), max_size=60))
def test_s1_any_sequence_of_events_keeps_every_job_accounted_for_exactly_once(
    events: list[tuple[str, str]],
) -> None:
    led = ledger(timeout=5.0)
    for rid in "abc":
        submit(led, rid)
    t = 0.0
    finished: list[str] = []
    failed: dict[str, str] = {}
    for ev, rid in events:
        t += 1.0
        try:
            if ev == "request":
                led.requests_due()
            elif ev == "grant":
                led.on_grant(grant(rid), PAGE, POOL, t)
            elif ev == "post":
                if any(j.request_id == rid for j in led.writes_due(t)):
                    post(led, rid, t)
            elif ev == "complete":
                led.write_completed(rid, PAGE, t)
            elif ev == "fail_write":
                led.write_failed(rid, "x", t)
            elif ev == "rewrite":
                try:
                    led.on_rewrite(protocol.Rewrite(request_id=rid))
                except FrozenJob:
                    led.fail(rid, "preempted", code="preempted")
            elif ev == "deadline":
                led.expire_granted(t, 3.0)
            elif ev == "preempt":
                led.freeze([rid])
            elif ev == "ack":
                led.on_ack(rid, t)
            elif ev == "lose":
                led.connection_lost(t)
            else:
                led.expire(t, "x", "h:1")
        except (ProtocolError, IllegalJobTransition):
            pass
        finished += led.take_finished()
        failed.update(led.take_failed())
        # S4: at most one WRITE per job, and only from a grant (S2)
        for j in led.jobs(JobState.WRITING):
            assert j.grant is not None
    live = {j.request_id for j in led.jobs()}
    assert len(finished) == len(set(finished))
    assert set(finished).isdisjoint(failed) and live.isdisjoint(finished) and live.isdisjoint(failed)
    assert live | set(finished) | set(failed) == set("abc")


def test_s3_an_ack_that_overtakes_the_posting_of_its_write_waits_for_its_completion() -> None:
    """UCX may move the bytes inside the posting call: the reader's Ack can arrive before
    the transport returns the handle. The job is WRITING from before the call, so the Ack
    waits for the completion and the handle is always settled."""
    led = ledger()
    submit(led, "a")
    to_granted(led, "a")
    led.writes_due(1.0)
    led.write_posting("a", 1.0, led.notification("a"))
    assert led.on_ack("a", 1.1) and "a" in led and led.take_finished() == []
    handle = object()
    assert led.write_started("a", handle) and led.job("a").xfer is handle
    led.write_completed("a", PAGE, 1.2)
    assert led.take_finished() == ["a"]


def test_a_job_that_failed_while_its_write_was_posted_leaves_the_handle_to_the_shell() -> None:
    led = ledger()
    submit(led, "a")
    to_granted(led, "a")
    led.write_posting("a", 1.0, led.notification("a"))
    (f,) = led.freeze(["a"])  # preempted meanwhile
    assert f.xfer is None  # the handle does not exist yet
    assert not led.write_started("a", object(), 0.25)  # the shell polls it to its end itself
    assert led.stats.post_s == 0.25  # the post's time counts whatever became of the job


def test_the_time_inside_posts_is_counted_apart_from_the_writes_in_flight() -> None:
    """``post_s`` (the transport's call, where a shared-memory WRITE copies) against
    ``write_s`` (post to completion): a copy slowed down tells apart from a wait."""
    led = ledger()
    for rid, post_s in (("a", 0.125), ("b", 0.5)):
        submit(led, rid)
        to_granted(led, rid)
        led.writes_due(1.0)
        led.write_posting(rid, 1.0, led.notification(rid))
        assert led.write_started(rid, object(), post_s)
        led.write_completed(rid, PAGE, 2.0)
    assert (led.stats.post_s, led.stats.write_s, led.stats.writes) == (0.625, 2.0, 2)


def test_a_held_job_is_neither_requested_nor_hashed_until_released() -> None:
    """Its step may still run on the device (the producer's ReadyGate): nothing may read
    its blocks, and it is not safe to preempt; a failure fails it by name, reader untold."""
    led = ledger(checksum=True)
    m = manifest("h")
    led.submit("h", m, list(range(10, 10 + m.num_blocks)), stripe(m.num_blocks, 0, 1), 0.0)
    led.hold("h")
    submit(led, "free")
    assert [j.request_id for j in led.requests_due()] == ["free"]
    assert [j.request_id for j in led.checksums_due()] == ["free"]
    assert led.job("h").held and led.unsafe(["h"]) == ["h"] and led.unwritten == 2
    led.hold("h", False)
    assert not led.job("h").held
    assert [j.request_id for j in led.checksums_due()] == ["h"]
    assert [j.request_id for j in led.requests_due()] == ["h"]
    m2 = manifest("bad")
    led.submit("bad", m2, list(range(m2.num_blocks)), stripe(m2.num_blocks, 0, 1), 0.0)
    led.hold("bad")
    why = "positions 0..39 were not written where the block table puts them"
    failure = led.fail("bad", why, FailureReason.OTHER)
    assert failure is not None and not failure.tell_reader
    assert led.take_failed() == {"bad": SampleFailure(FailureReason.OTHER, why)}


# ------------------------------------------------------- counters and metrics
def test_the_shells_reconnects_and_hashing_are_counted_by_the_ledger() -> None:
    led = ledger()
    mark = led.metrics_mark()
    led.reconnected()
    assert led.metrics_mark() != mark  # a reconnect is news for the metrics
    led.hashed(0.25)
    led.hashed(0.5)
    st_ = led.stats.snapshot()
    assert (st_.reconnects, st_.checksum_s) == (1, 0.75)


def test_take_metrics_reads_counters_observations_and_jobs_at_once_and_marks_what_it_read() -> None:
    led = ledger()
    submit(led, "a")
    submit(led, "b")
    to_writing(led, "a", t=1.0)  # granted 1 s after its submission
    led.write_completed("a", 3 * PAGE, 1.5)
    led.on_ack("a", 2.0)
    m = led.take_metrics()
    assert (m.stats.requests, m.stats.writes, m.stats.bytes, m.stats.ack_wait_s) == (1, 1, 3 * PAGE, 0.5)
    assert m.observations == SenderObservations([0.5], [1.0]) and m.in_flight == 1
    assert m.mark == led.metrics_mark()  # nothing new since
    assert led.take_metrics().observations == SenderObservations([], [])  # taken once
    led.requests_due()
    led.on_grant(grant("b"), PAGE, POOL, 3.0)
    assert led.metrics_mark() != m.mark  # a grant's wait was observed


def test_only_the_ledger_writes_its_counters() -> None:
    """The shells tell the ledger what happened and what it took; none writes its stats."""
    writes = re.compile(r"ledger\.stats\.\w+\s*(\+|-)?=(?!=)")
    found = [
        f"{path.name}: {line.strip()}"
        for path in pathlib.Path(wing.__file__).parent.glob("*.py")
        for line in path.read_text().splitlines()
        if writes.search(line)
    ]
    assert found == []
