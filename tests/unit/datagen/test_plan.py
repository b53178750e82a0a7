"""The data-generation driver's bookkeeping: rows go out in order, at most one request per
row; failures are retried with a growing backoff and given up after the attempts, with
their last reason; "pending" waits for the row's file when there is a directory to look
in; the progress figures and their formatting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_connector.datagen import plan
from kv_connector.datagen.plan import IllegalRowTransition, RowBook, RowState
from kv_connector.datagen.row_states import ROWS, RowEvent
from kv_connector.wire.outcome import SampleStatus


def book(n: int = 3, **kw: object) -> RowBook:
    return RowBook({i: 10 * (i + 1) for i in range(n)}, **kw)  # type: ignore[arg-type]


def test_rows_go_out_in_order_once_each() -> None:
    b = book(3)
    assert [b.take(0.0), b.take(0.0), b.take(0.0), b.take(0.0)] == [0, 1, 2, None]
    for i in range(3):
        assert b.state(i) is RowState.SENT
        b.answered(i, SampleStatus.DELIVERED, "", 1.0)
    assert b.done and b.counts() == plan.Counts(3, 3, 0, 0, 0, 0, 0, 60)


def test_a_failed_row_is_retried_after_a_growing_backoff_then_given_up_with_its_reason() -> None:
    b = book(1, max_attempts=3, backoff_s=1.0)
    assert b.take(0.0) == 0
    b.answered(0, SampleStatus.FAILED, "cannot reach the reader", 0.0)
    assert b.state(0) is RowState.QUEUED and b.take(0.5) is None and b.next_due() == 1.0
    assert b.take(1.0) == 0
    b.not_answered(0, "HTTP 503: busy", 1.0)
    assert b.take(2.9) is None and b.take(3.0) == 0  # 2 s the second time
    b.not_answered(0, "ConnectionRefusedError", 3.0)
    assert b.done and b.given_up() == {0: "ConnectionRefusedError"}
    assert b.counts().retries == 2 and b.counts().gave_up == 1


def test_a_request_the_server_will_always_refuse_is_given_up_at_once() -> None:
    b = book(2)
    b.take(0.0)
    b.not_answered(0, "HTTP 400: prompt too long", 0.0, retry=False)
    assert b.given_up() == {0: "HTTP 400: prompt too long"} and b.counts().retries == 0


def test_a_retried_row_does_not_hold_up_the_others() -> None:
    b = book(3, backoff_s=10.0)
    b.take(0.0)
    b.answered(0, SampleStatus.FAILED, "x", 0.0)
    assert b.take(0.0) == 1 and b.take(0.0) == 2 and b.take(0.0) is None
    assert b.take(10.0) == 0


def test_pending_counts_as_delivered_unconfirmed_without_a_directory() -> None:
    b = book(2)
    b.take(0.0)
    b.take(0.0)
    b.answered(0, SampleStatus.PENDING, "", 1.0)
    b.answered(1, SampleStatus.DELIVERED, "", 1.0)
    c = b.counts()
    assert b.done and c.delivered == 2 and c.unconfirmed == 1


def test_with_a_directory_pending_waits_for_the_file_then_counts() -> None:
    b = book(2, confirm=True, confirm_timeout_s=5.0)
    b.take(0.0)
    b.take(0.0)
    b.answered(0, SampleStatus.PENDING, "", 1.0)
    b.answered(1, SampleStatus.PENDING, "", 1.0)
    assert not b.done and b.awaiting() == [0, 1] and b.counts().awaiting == 2
    b.file_seen(0, 2.0)
    assert b.state(0) is RowState.DELIVERED and b.counts().unconfirmed == 0
    # row 1's file never comes: sent again after the timeout
    assert b.expire(5.9) == [] and b.expire(6.0) == [1]
    assert b.state(1) is RowState.QUEUED and "did not appear within 5 s" in b.last_error(1)


def test_a_row_whose_states_fail_the_audit_is_given_up_not_sent_again() -> None:
    b = book(2, confirm=True)
    b.take(0.0)
    b.take(0.0)
    b.answered(0, SampleStatus.PENDING, "", 1.0)
    b.answered(1, SampleStatus.PENDING, "", 1.0)
    b.file_seen(0, 2.0)
    b.file_seen(1, 2.0)
    b.audit_failed(1, "logprob audit: mean error 0.4", 2.0)
    assert b.done and b.given_up() == {1: "logprob audit: mean error 0.4"}
    assert b.counts().delivered == 1 and b.take(3.0) is None
    with pytest.raises(IllegalRowTransition):
        b.audit_failed(1, "again", 3.0)


def test_transitions_outside_their_state_are_illegal() -> None:
    b = book(1, confirm=True)
    with pytest.raises(IllegalRowTransition):
        b.answered(0, SampleStatus.DELIVERED, "", 0.0)  # never sent
    b.take(0.0)
    with pytest.raises(IllegalRowTransition):
        b.file_seen(0, 0.0)  # not awaiting its file
    b.answered(0, SampleStatus.DELIVERED, "", 0.0)
    with pytest.raises(IllegalRowTransition):
        b.not_answered(0, "late", 0.0)
    with pytest.raises(IllegalRowTransition):
        b.answered(7, SampleStatus.DELIVERED, "", 0.0)
    with pytest.raises(ValueError):
        book(1, max_attempts=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["delivered", "pending", "failed", "none", "seen", "expire"]), max_size=60))
def test_every_row_ends_delivered_or_given_up_and_at_most_one_request_is_in_flight(ops: list[str]) -> None:
    b = book(4, confirm=True, max_attempts=2, backoff_s=0.0, confirm_timeout_s=1.0)
    now, sent = 0.0, set()
    for op in [*ops, *["delivered"] * 40]:
        now += 1.0
        i = b.take(now)
        if i is not None:
            assert i not in sent
            sent.add(i)
        if op == "seen":
            for r in b.awaiting():
                b.file_seen(r, now)
        elif op == "expire":
            b.expire(now)
        elif sent:
            r = sent.pop()
            if op == "none":
                b.not_answered(r, "x", now)
            else:
                b.answered(r, SampleStatus(op) if op != "pending" else SampleStatus.PENDING, "", now)
        for r in b.awaiting():
            b.file_seen(r, now)
    c = b.counts()
    assert b.done and c.delivered + c.gave_up == 4 and c.in_flight == 0 and c.awaiting == 0


def test_progress_figures_and_their_formats() -> None:
    p = plan.progress(rows=100, rows_done=25, tokens=10_000, tokens_done=2_000, elapsed_s=10.0)
    assert (p.rows_per_s, p.tokens_per_s, p.eta_s, p.fraction) == (2.5, 200.0, 40.0, 0.25)
    assert plan.line(p, 3, 1) == "25/100 rows (25.0%), 2.5 rows/s, 200 tokens/s, ETA 40s, 3 retried, 1 failed"
    assert plan.bar(p, 0, 0, width=8) == "[##......] 25/100 rows 200 tok/s ETA 40s"
    assert plan.progress(10, 0, 100, 0, 0.0).eta_s is None
    assert plan.progress(10, 10, 100, 100, 5.0).eta_s == 0.0
    assert plan.progress(10, 5, 0, 0, 5.0).eta_s == 5.0  # no token counts: by rows
    assert [plan.duration(x) for x in (None, 42, 185, 3725)] == ["?", "42s", "3m05s", "1h02m"]
    assert [plan.rate(x) for x in (950, 12_345, 4_560_000)] == ["950", "12.3k", "4.56M"]


def test_row_selections() -> None:
    assert plan.parse_rows("2:5", 10) == [2, 3, 4]
    assert plan.parse_rows(":3", 10) == [0, 1, 2] and plan.parse_rows("8:", 10) == [8, 9]
    assert plan.parse_rows("4,1,4", 10) == [4, 1]
    for bad in ("5:11", "3:2", "10", "-1"):
        with pytest.raises(ValueError):
            plan.parse_rows(bad, 10)


def test_every_row_state_is_reachable_from_queued_and_only_gave_up_is_final() -> None:
    seen, todo = {RowState.QUEUED}, [RowState.QUEUED]
    while todo:
        for to in ROWS.exits(todo.pop()).values():
            if to not in seen:
                seen.add(to)
                todo.append(to)
    assert seen == set(RowState)
    assert ROWS.terminal() == {RowState.GAVE_UP}
    with pytest.raises(IllegalRowTransition, match="row 4: taken is not allowed in state sent"):
        ROWS.step(RowState.SENT, RowEvent.TAKEN, "row 4")


def test_the_book_moves_a_row_only_through_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take one transition out of the table: the book refuses it, and the row stays where
    it was (nothing moved before the table said yes)."""
    rules = {k: v for k, v in ROWS.rules.items() if k != (RowState.SENT, RowEvent.DELIVERED)}
    monkeypatch.setattr(ROWS, "rules", rules)
    b = RowBook({0: 10})
    assert b.take(0.0) == 0
    with pytest.raises(IllegalRowTransition, match="row 0: delivered is not allowed in state sent"):
        b.answered(0, SampleStatus.DELIVERED, "", 1.0)
    assert b.state(0) is RowState.SENT and b.counts().delivered == 0
