"""Credits ahead in the sender's ledger (S10 of ``kv_connector.sender.ledger``): new jobs
placed in runs of pages the reader granted before they were needed, with no credit round
trip; credits given back when they fit nothing or are recalled; resends ask again. Pure."""

from __future__ import annotations

import pytest

from kv_connector.sender.job_states import JobState
from kv_connector.wire.failure import FailureReason
from kv_connector.wire.protocol import ProtocolError
from tests.unit.sender.helpers import PAGE, POOL, credit, held, ledger, post, submit


def test_s10_a_new_job_is_placed_in_a_credit_at_its_start_with_no_request() -> None:
    led = ledger()
    held(led, credit(7, first=4, pages=4))
    submit(led, "a", n=20, t=1.0)  # 2 pages
    placed, back = led.place_due(1.5, PAGE)
    assert [j.request_id for j in placed] == ["a"] and back == []
    assert led.state_of("a") is JobState.GRANTED and led.requests_due() == []
    g = placed[0].grant
    assert g is not None and (g.first_page, g.num_pages, g.generation) == (4, 2, 7)
    assert [j.request_id for j in led.writes_due(2.0)] == ["a"]
    assert post(led, "a", 2.0).generation == 7  # its WRITE names the credit
    assert led.stats.placed == 1 and led.stats.credits == 1 and led.credits == 0
    led.write_completed("a", 100, 2.5)
    led.on_ack("a", 3.0)
    assert led.take_finished() == ["a"]


def test_s10_jobs_take_credits_oldest_first_the_rest_ask() -> None:
    led = ledger()
    held(led, credit(1, 0), credit(2, 3))
    for rid in "abc":
        submit(led, rid)
    placed, back = led.place_due(1.0, PAGE)
    assert [j.request_id for j in placed] == ["a", "b"] and back == []
    assert [j.request_id for j in led.requests_due()] == ["c"]


def test_s10_a_job_no_credit_holds_gives_every_credit_back_and_asks() -> None:
    led = ledger()
    held(led, credit(1, 0, pages=2), credit(2, 2, pages=2))
    submit(led, "big", n=40)  # 3 pages
    submit(led, "small", n=10)
    placed, back = led.place_due(1.0, PAGE)
    assert placed == [] and back == [1, 2] and led.credits == 0
    assert [j.request_id for j in led.requests_due()] == ["big", "small"]


def test_s10_a_held_job_is_not_placed_until_its_step_is_done() -> None:
    led = ledger()
    held(led, credit(1))
    submit(led, "a")
    led.hold("a")
    assert led.place_due(1.0, PAGE) == ([], [])
    led.hold("a", False)
    assert [j.request_id for j in led.place_due(1.0, PAGE)[0]] == ["a"]


def test_s10_s2_a_lost_connection_drops_credits_and_a_resend_asks_for_its_pages() -> None:
    led = ledger()
    held(led, credit(1), credit(2, 3))
    submit(led, "a")
    led.place_due(1.0, PAGE)
    led.connection_lost(2.0)
    assert led.credits == 0 and led.state_of("a") is JobState.WAITING
    held(led, credit(3, 6))  # the new connection's
    assert led.place_due(3.0, PAGE) == ([], [])  # placed once: it asks again (same pages)
    assert [j.request_id for j in led.requests_due()] == ["a"]


def test_s10_a_recalled_credit_is_given_back_unless_a_job_was_placed_in_it() -> None:
    led = ledger()
    held(led, credit(1), credit(2, 3))
    submit(led, "a")
    led.place_due(1.0, PAGE)  # in credit 1
    assert led.on_recall(1) is False  # its Placed answers
    assert led.on_recall(2) is True and led.credits == 0
    assert led.on_recall(2) is False


def test_s10_s9_a_placed_job_that_fails_tells_the_reader_and_fences_its_credit() -> None:
    led = ledger()
    held(led, credit(9))
    submit(led, "a")
    led.place_due(1.0, PAGE)
    f = led.fail("a", "gone", FailureReason.OTHER)
    assert f is not None and f.tell_reader and f.generation == 9


@pytest.mark.parametrize("bad", ["outside", "twice"])
def test_s10_a_credit_outside_the_pool_or_granted_twice_is_the_readers_protocol_error(bad: str) -> None:
    led = ledger()
    held(led, credit(1))
    c = credit(2, first=POOL // PAGE - 1, pages=2) if bad == "outside" else credit(1)
    with pytest.raises(ProtocolError):
        led.on_credit(c, PAGE, POOL)


def test_s10_leaving_gives_every_unused_credit_back() -> None:
    led = ledger()
    held(led, credit(1), credit(2, 3))
    submit(led, "a")
    led.place_due(1.0, PAGE)  # in credit 1
    assert led.give_back_credits() == [2] and led.credits == 0
    assert led.give_back_credits() == []
