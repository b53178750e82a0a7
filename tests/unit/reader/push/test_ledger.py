"""The reader's sample ledger as a state machine: every transition, every illegal one,
and the invariants R1-R7 of ``kv_connector.reader.push.ledger`` (each test names the one it
proves). Hostile credit requests from an authenticated producer are modelled here too:
what reaches the ledger has passed the wire protocol's decoder, so the ledger decides
the rest. Pure: no transport, no sockets, no threads; times are passed in."""

from __future__ import annotations

import pathlib
import re

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_connector.reader as wing
from kv_connector.reader.push.records import (
    AckMode,
    IllegalSampleTransition,
    Log,
    RequireChecksum,
    SampleState,
)
from kv_connector.wire import protocol
from kv_connector.wire.protocol import ProtocolError
from kv_connector.wire.provenance import Expectation
from tests.unit.reader.push.helpers import (
    LAYOUT,
    PAGE,
    check_all,
    checked_sample,
    checks,
    connected,
    credit,
    done,
    hand_out,
    hello,
    land,
    ledger,
    manifest,
    readies,
    sends,
    written,
)


# ------------------------------------------------------------- the happy path
def test_a_sample_goes_promised_granted_written_checked_handed_out_released() -> None:
    led = ledger(pages=8)
    connected(led, (1, hello()))
    actions = led.credit_request(1, credit("a"), 0.0)
    ((peer, g),) = sends(actions, protocol.Grant)
    assert peer == 1 and isinstance(g, protocol.Grant) and g.pages == range(0, 3)
    assert led.view.state_of(("p", "a")) is SampleState.GRANTED and led.view.expecting_writes
    (v,) = checks(led.write_done(1, done(led, 1, "a", checksum=9)))
    assert led.view.state_of(("p", "a")) is SampleState.WRITTEN and v.checksum == 9
    assert readies(led.share_checked(v.key, v.rank, v.landing, True, 0.5)) == [("p", "a")]
    assert led.view.state_of(("p", "a")) is SampleState.CHECKED
    got = led.hand_out(("p", "a"), 1.0)
    assert got is not None
    ready, actions = got
    assert sends(actions, protocol.Ack) == [(1, protocol.Ack(request_id="a"))]
    assert led.view.state_of(("p", "a")) is SampleState.HANDED_OUT and ("p", "a") in led.delivered
    assert [s.key for s in led.view.leases()] == [ready.key] == [("p", "a")] and ready.base == 0
    assert led.view.pool is not None and led.view.pool.free_pages == 5  # R3: on lease, the pages stay taken
    assert led.release(("p", "a"), 2.0) == []
    assert led.view.state_of(("p", "a")) is None and led.view.pool.free_pages == 8
    m = manifest("a", 40)
    assert (led.stats.samples, led.stats.bytes) == (1, m.num_tokens * m.geometry.token_bytes)
    assert led.release(("p", "a"), 3.0) == []  # released once


def test_r7_samples_wait_for_pages_in_arrival_order() -> None:
    led = ledger(pages=4)
    connected(led, (1, hello()))
    assert sends(led.credit_request(1, credit("big", 60), 0.0), protocol.Grant)  # 4 pages
    assert led.view.state_of(("p", "big")) is SampleState.GRANTED
    assert not sends(led.credit_request(1, credit("next", 40), 0.0), protocol.Grant)
    assert led.view.state_of(("p", "next")) is SampleState.PROMISED
    assert not sends(led.credit_request(1, credit("small", 1), 0.0), protocol.Grant)  # FIFO: behind next
    land(led, 1, "big")
    hand_out(led, ("p", "big"))
    assert not sends(led.credit_request(1, credit("other", 1), 0.0), protocol.Grant)  # R3: on lease
    granted = [m.request_id for _, m in sends(led.release(("p", "big"), 1.0), protocol.Grant)]
    assert granted == ["next", "small"]


def test_r3_the_checks_run_as_shares_land_not_when_the_user_takes_them() -> None:
    led = ledger()
    connected(led, (1, hello(rank=0, world=2)), (2, hello(rank=1, world=2)))
    led.credit_request(1, credit("a", rank=0, world=2), 0.0)
    led.credit_request(2, credit("a", rank=1, world=2), 0.0)
    (v0,) = checks(led.write_done(1, done(led, 1, "a", checksum=1)))
    assert led.share_checked(v0.key, 0, v0.landing, True, 0.0) == []  # rank 1 not landed yet
    assert led.view.state_of(("p", "a")) is SampleState.GRANTED
    (v1,) = checks(led.write_done(2, done(led, 2, "a", checksum=2)))
    assert readies(led.share_checked(v1.key, 1, v1.landing, True, 0.0)) == [("p", "a")]


def test_a_checksum_that_follows_its_write_is_checked_when_it_comes_in_either_order() -> None:
    led = ledger()
    connected(led, (1, hello()), (2, hello("q")))
    led.credit_request(1, credit("late"), 0.0)
    assert checks(led.write_done(1, done(led, 1, "late", checksum_follows=True))) == []
    assert led.view.state_of(("p", "late")) is SampleState.WRITTEN  # landed, its checksum awaited
    (v,) = checks(led.late_checksum(1, protocol.LateChecksum(request_id="late", checksum=3)))
    assert v.checksum == 3
    led.credit_request(2, credit("early"), 0.0)  # the checksum overtakes the notification
    assert led.late_checksum(2, protocol.LateChecksum(request_id="early", checksum=4)) == []
    (v,) = checks(led.write_done(2, done(led, 2, "early", checksum_follows=True)))
    assert v.checksum == 4


def test_a_share_without_a_checksum_is_not_checked_when_none_is_required() -> None:
    led = ledger(require_checksum=RequireChecksum.NEVER)
    connected(led, (1, hello()))
    led.credit_request(1, credit("a"), 0.0)
    actions = led.write_done(1, done(led, 1, "a"))
    assert checks(actions) == [] and readies(actions) == [("p", "a")]


def test_a_reader_that_does_not_verify_hands_out_on_landing() -> None:
    led = ledger(verify=False)
    connected(led, (1, hello()))
    led.credit_request(1, credit("a"), 0.0)
    assert readies(led.write_done(1, done(led, 1, "a", checksum=1))) == [("p", "a")]


def test_a_check_of_an_older_landing_is_ignored() -> None:
    led = ledger()
    key = written(led)
    (old,) = checks(led.write_done(1, done(led, 1, "a", checksum=5)))  # landed again
    assert old.landing == 2
    assert led.share_checked(key, 0, 1, False, 0.0) == []  # the first landing's result: stale
    assert readies(led.share_checked(key, 0, 2, True, 0.0)) == [key]


def test_r1_a_page_belongs_to_one_sample_at_a_time() -> None:
    led = ledger(pages=8)
    connected(led, (1, hello()))
    pages: list[int] = []
    for rid in ("a", "b"):
        ((_, g),) = sends(led.credit_request(1, credit(rid), 0.0), protocol.Grant)
        assert isinstance(g, protocol.Grant)
        pages += list(g.pages)
    assert len(pages) == len(set(pages)) == 6


def test_a_sample_larger_than_the_pool_is_refused_by_name() -> None:
    led = ledger(pages=2)
    connected(led, (1, hello()))
    actions = led.credit_request(1, credit("huge", 100), 0.0)
    ((_, r),) = sends(actions, protocol.Refuse)
    assert isinstance(r, protocol.Refuse) and r.code == "pool_too_small" and r.request_id == "huge"
    assert "make the reader's pool larger" in r.message and led.view.state_of(("p", "huge")) is None
    assert led.stats.refused == 1


# ----------------------------------------------------------- tensor parallel
def test_r2_a_sample_is_written_only_when_every_rank_registered_and_landed() -> None:
    led = ledger()
    connected(led, (1, hello(rank=0, world=2)), (2, hello(rank=1, world=2)))
    led.credit_request(1, credit("a", rank=0, world=2), 0.0)
    assert readies(land(led, 1, "a")) == []  # rank 1 not registered
    grant = sends(led.credit_request(2, credit("a", rank=1, world=2), 0.0), protocol.Grant)
    assert [p for p, _ in grant] == [2]  # the late rank gets the same pages
    assert led.view.state_of(("p", "a")) is SampleState.GRANTED
    assert readies(land(led, 2, "a")) == [("p", "a")]


def test_r2_a_rank_with_an_empty_share_counts_as_landed() -> None:
    led = ledger()
    connected(led, (1, hello(rank=0, world=2)), (2, hello(rank=1, world=2)))
    led.credit_request(2, credit("one", 5, rank=1, world=2), 0.0)  # rank 1: no block
    led.credit_request(1, credit("one", 5, rank=0, world=2), 0.0)
    assert readies(land(led, 1, "one")) == [("p", "one")]


@pytest.mark.parametrize(
    "second, match",
    [
        ([0, 1], "both promise blocks"),
        ([], "leave blocks unwritten"),
    ],
)
def test_r2_shares_must_tile_the_blocks_exactly(second: list[int], match: str) -> None:
    led = ledger()
    connected(led, (1, hello(rank=0, world=2)), (2, hello(rank=1, world=2)))
    led.credit_request(1, protocol.CreditRequest(manifest=manifest("a"), blocks=[0, 1]), 0.0)
    with pytest.raises(ProtocolError, match=match):
        led.credit_request(2, protocol.CreditRequest(manifest=manifest("a"), blocks=second), 0.0)


def test_ranks_must_send_the_same_manifest_and_keep_their_share() -> None:
    led = ledger()
    connected(led, (1, hello(rank=0, world=2)), (2, hello(rank=1, world=2)))
    led.credit_request(1, protocol.CreditRequest(manifest=manifest("a"), blocks=[0, 1]), 0.0)
    with pytest.raises(ProtocolError, match="differs from the first"):
        led.credit_request(2, protocol.CreditRequest(manifest=manifest("a", 33), blocks=[2]), 0.0)
    with pytest.raises(ProtocolError, match="changed its share"):
        led.credit_request(1, protocol.CreditRequest(manifest=manifest("a"), blocks=[0]), 0.0)


def test_a_rank_that_reconnects_resends_into_the_same_pages() -> None:
    led = ledger()
    connected(led, (1, hello()))
    ((_, g1),) = sends(led.credit_request(1, credit("a"), 0.0), protocol.Grant)
    led.peer_gone(1, 1.0)
    connected(led, (7, hello()))  # within the grace: the producer is back
    ((peer, g2),) = sends(led.credit_request(7, credit("a"), 1.1), protocol.Grant)
    assert peer == 7 and g1 == g2
    assert readies(land(led, 7, "a")) == [("p", "a")]


# ------------------------------------------------------------------ peers
def test_a_rank_connects_once_and_keeps_its_world_size() -> None:
    led = ledger()
    connected(led, (1, hello(rank=0, world=2)))
    assert led.view.rank_connected("p", 0) and led.view.world_of("p") == 2
    with pytest.raises(ProtocolError, match="already connected"):
        led.peer_ready(2, hello(rank=0, world=2))
    with pytest.raises(ProtocolError, match="world size 2 before, now 3"):
        led.peer_ready(3, hello(rank=1, world=3))


def test_messages_from_a_peer_that_is_not_a_connected_producer_are_illegal() -> None:
    led = ledger()
    with pytest.raises(IllegalSampleTransition):
        led.credit_request(9, credit("a"), 0.0)
    with pytest.raises(IllegalSampleTransition):
        led.write_done(9, done(led, 9, "a"))


def test_r6_a_gone_producers_incomplete_samples_wait_for_its_last_notifications() -> None:
    led = ledger(pages=8)
    connected(led, (1, hello()))
    led.credit_request(1, credit("landing"), 0.0)  # granted, its WriteDone still on its way
    led.credit_request(1, credit("lost"), 0.0)
    assert led.peer_gone(1, 10.0) == []  # grace: notifications may still come
    assert led.view.departing and not led.forgotten(1)
    assert readies(land(led, 1, "landing")) == [("p", "landing")]
    logs = [a for a in led.tick(10.3) if isinstance(a, Log)]
    assert any("discarded incomplete sample lost" in a.text for a in logs)
    assert led.forgotten(1) and led.view.state_of(("p", "lost")) is None
    assert led.view.state_of(("p", "landing")) is SampleState.CHECKED  # complete: kept
    assert led.view.pool is not None and led.view.pool.free_pages == 2  # lost's pages are quarantined (R3)
    led.tick(10.3 + led.config.quarantine_s)
    assert led.view.pool.free_pages == 5


def test_r6_a_departure_with_nothing_awaited_is_settled_at_once() -> None:
    led = ledger()
    connected(led, (1, hello()))
    led.peer_gone(1, 1.0)
    assert led.forgotten(1) and not led.view.departing and "p" not in led.producers


def test_r6_samples_survive_while_another_rank_of_the_producer_is_connected() -> None:
    led = ledger()
    connected(led, (1, hello(rank=0, world=2)), (2, hello(rank=1, world=2)))
    led.credit_request(1, credit("a", rank=0, world=2), 0.0)
    led.peer_gone(1, 0.0)
    led.tick(5.0)
    assert led.view.state_of(("p", "a")) is SampleState.GRANTED  # kept: rank 0 may come back


def test_settling_a_departure_early_keeps_the_reconnected_producers_samples() -> None:
    led = ledger()
    connected(led, (1, hello()))
    led.credit_request(1, credit("a"), 0.0)
    led.peer_gone(1, 1.0)
    connected(led, (2, hello()))
    assert [a for a in led.settle(1, 1.05) if isinstance(a, Log)] == []
    assert led.forgotten(1) and led.view.state_of(("p", "a")) is SampleState.GRANTED


def test_a_sample_whose_pages_never_came_is_cancelled_not_quarantined() -> None:
    led = ledger(pages=3)
    connected(led, (1, hello()))
    led.credit_request(1, credit("a"), 0.0)
    led.credit_request(1, credit("b"), 0.0)  # waits for pages
    led.peer_gone(1, 0.0)
    led.tick(1.0)
    assert led.view.pool is not None and led.view.pool.waiting == 0


# ------------------------------------------------------------ refusals
def test_a_producer_giving_up_drops_the_sample_and_tells_its_other_ranks() -> None:
    led = ledger()
    connected(led, (1, hello(rank=0, world=2)), (2, hello(rank=1, world=2)))
    led.credit_request(1, credit("a", rank=0, world=2), 0.0)
    led.credit_request(2, credit("a", rank=1, world=2), 0.0)
    actions = led.producer_refused(
        2, protocol.Refuse(code="write_failed", message="NIXL", request_id="a"), 1.0
    )
    ((peer, r),) = sends(actions, protocol.Refuse)
    assert peer == 1 and isinstance(r, protocol.Refuse) and r.message == "rank 1: NIXL"
    assert led.view.state_of(("p", "a")) is None


def test_a_refusal_of_a_sample_it_never_promised_is_only_logged() -> None:
    led = ledger()
    connected(led, (1, hello()))
    actions = led.producer_refused(1, protocol.Refuse(code="protocol", message="hm", request_id="x"), 0.0)
    assert all(isinstance(a, Log) for a in actions) and actions


def test_a_refusal_racing_the_hand_out_does_not_take_the_sample_away() -> None:
    led = ledger()
    key = checked_sample(led)
    actions = led.producer_refused(1, protocol.Refuse(code="write_failed", message="x", request_id="a"), 0.0)
    assert not sends(actions, protocol.Refuse) and led.view.state_of(key) is SampleState.CHECKED
    hand_out(led, key)


# --------------------------------------------------------------- checksums
def test_r5_a_mismatching_share_is_written_again() -> None:
    led = ledger()
    key = written(led)
    (v,) = checks(led.write_done(1, done(led, 1, "a", checksum=5)))
    actions = led.share_checked(key, 0, v.landing, False, 1.0)
    ((peer, rw),) = sends(actions, protocol.Rewrite)
    assert peer == 1 and isinstance(rw, protocol.Rewrite) and rw.request_id == "a"
    assert led.view.state_of(key) is SampleState.GRANTED and led.stats.checksum_mismatches == 1
    assert readies(land(led, 1, "a")) == [key]


def test_r5_past_max_rewrites_the_sample_is_refused_and_never_handed_out() -> None:
    led = ledger(max_rewrites=2)
    connected(led, (1, hello()))
    led.credit_request(1, credit("a"), 0.0)
    key = ("p", "a")
    for _ in range(2):
        actions = led.write_done(1, done(led, 1, "a", checksum=5))
        assert sends(check_all(led, actions, ok=False), protocol.Rewrite)
    actions = check_all(led, led.write_done(1, done(led, 1, "a", checksum=5)), ok=False)
    ((_, r),) = sends(actions, protocol.Refuse)
    assert isinstance(r, protocol.Refuse) and r.code == "checksum" and "3 times" in r.message
    assert led.view.state_of(key) is None and led.hand_out(key, 0.0) is None


def test_a_mismatch_with_its_producer_gone_discards_the_sample() -> None:
    led = ledger()
    connected(led, (1, hello()))
    led.credit_request(1, credit("a"), 0.0)
    actions = led.write_done(1, done(led, 1, "a", checksum=5))
    led.peer_gone(1, 0.0)
    check_all(led, actions, ok=False)
    assert led.view.state_of(("p", "a")) is None


# ---------------------------------------------------------- rejections (R11)
def test_r11_a_checked_sample_rejected_before_hand_out_is_refused_to_every_rank() -> None:
    led = ledger(pages=8)
    connected(led, (1, hello(world=2)), (2, hello(rank=1, world=2)))
    led.credit_request(1, credit("a", rank=0, world=2), 0.0)
    led.credit_request(2, credit("a", rank=1, world=2), 0.0)
    land(led, 1, "a")
    assert readies(land(led, 2, "a")) == [("p", "a")]
    actions = led.reject(("p", "a"), "NaN at token 3", 1.0)
    refusals = sends(actions, protocol.Refuse)
    assert sorted(p for p, _ in refusals) == [1, 2]
    assert all(
        isinstance(r, protocol.Refuse) and r.code == "rejected" and "NaN" in r.message for _, r in refusals
    )
    assert not sends(actions, protocol.Ack)
    assert led.view.state_of(("p", "a")) is None and led.hand_out(("p", "a"), 1.0) is None
    assert led.stats.refused == 1
    # every share landed: no WRITE into its pages is on its way, they are free at once (R3)
    assert led.view.pool is not None and led.view.pool.free_pages == 8


def test_r9_a_sample_rejected_before_hand_out_no_longer_counts_against_its_rank() -> None:
    led = ledger(pages=8, max_pending_per_rank=1)
    key = checked_sample(led, "a", n=16)
    led.reject(key, "NaN at token 3", 1.0)
    led.credit_request(1, credit("b", n=16), 1.0)  # not over the bound: "a" left the books
    assert led.view.state_of(("p", "b")) is SampleState.GRANTED


def test_r11_a_handed_out_sample_not_acked_yet_is_refused_instead_of_acked() -> None:
    led = ledger(ack_mode=AckMode.MANUAL)
    key = checked_sample(led)
    hand_out(led, key)
    actions = led.reject(key, "cannot write its file", 1.0)
    assert [p for p, _ in sends(actions, protocol.Refuse)] == [1] and not sends(actions, protocol.Ack)
    assert led.ack(key) == []  # never acked afterwards
    assert led.view.state_of(key) is SampleState.HANDED_OUT  # its pages return on release
    led.release(key, 2.0)
    assert led.view.state_of(key) is None


def test_r11_an_acked_sample_cannot_be_rejected() -> None:
    led = ledger()  # acked on take
    key = checked_sample(led)
    hand_out(led, key)
    with pytest.raises(IllegalSampleTransition, match="acknowledged"):
        led.reject(key, "too late", 1.0)
    with pytest.raises(IllegalSampleTransition):
        led.reject(("p", "nope"), "never seen", 1.0)


# -------------------------------------------------------------------- acks
def test_r4_a_resend_of_a_delivered_sample_is_acked_not_delivered_again() -> None:
    led = ledger()
    key = checked_sample(led)
    hand_out(led, key)
    # on lease: a resend is acked, not granted (its pages are the user's)
    assert sends(led.credit_request(1, credit("a"), 1.0), protocol.Ack) == [(1, protocol.Ack(request_id="a"))]
    led.release(key, 1.0)
    assert sends(led.credit_request(1, credit("a"), 2.0), protocol.Ack)
    assert led.view.state_of(key) is None and led.stats.resends_acked == 2


def test_r4_in_manual_mode_the_producer_is_acked_when_the_user_acks() -> None:
    led = ledger(ack_mode=AckMode.MANUAL)
    key = checked_sample(led)
    assert not sends(hand_out(led, key), protocol.Ack)
    # a resend before the ack waits for it too
    assert led.credit_request(1, credit("a"), 1.0) == []
    assert [p for p, _ in sends(led.ack(key), protocol.Ack)] == [1, 1]
    assert led.ack(key) == []  # acked once
    assert sends(led.credit_request(1, credit("a"), 2.0), protocol.Ack)  # later resends: at once


def test_r4_samples_delivered_before_the_reader_started_are_acked() -> None:
    led = ledger(already_delivered=lambda pid, rid: (pid, rid) == ("p", "old"))
    connected(led, (1, hello()))
    assert sends(led.credit_request(1, credit("old"), 0.0), protocol.Ack)
    assert sends(led.credit_request(1, credit("new"), 0.0), protocol.Grant)


def test_the_delivered_memory_is_bounded() -> None:
    led = ledger(delivered_memory=2)
    connected(led, (1, hello()))
    for rid in "abc":
        led.credit_request(1, credit(rid), 0.0)
        land(led, 1, rid)
        hand_out(led, ("p", rid))
        led.release(("p", rid), 0.0)
    assert list(led.delivered) == [("p", "b"), ("p", "c")]


def test_leases_are_listed_oldest_first() -> None:
    led = ledger(pages=9)
    connected(led, (1, hello()))
    for rid in "abc":
        led.credit_request(1, credit(rid), 0.0)
        land(led, 1, rid)
    for t, rid in ((3.0, "b"), (1.0, "c"), (2.0, "a")):
        hand_out(led, ("p", rid), now=t)
    assert [s.key[1] for s in led.view.leases()] == ["c", "a", "b"]


# ------------------------------------------------------- illegal transitions
@pytest.mark.parametrize("state", ["promised", "granted", "written", "checked", "handed_out", "released"])
def test_user_transitions_outside_their_state_do_nothing(state: str) -> None:
    led = ledger(pages=3)
    connected(led, (1, hello()))
    if state == "promised":
        led.credit_request(1, credit("blocker"), 0.0)
    led.credit_request(1, credit("a"), 0.0)
    key = ("p", "a")
    if state not in ("promised", "granted"):
        actions = led.write_done(1, done(led, 1, "a", checksum=1))
        if state != "written":
            check_all(led, actions)
    if state in ("handed_out", "released"):
        hand_out(led, key)
    if state == "released":
        led.release(key, 0.0)
    assert led.view.state_of(key) is (None if state == "released" else SampleState(state))
    if state != "checked":
        assert led.hand_out(key, 0.0) is None  # not ready (or gone): get() skips it
    if state != "handed_out":
        assert led.release(key, 0.0) == []
        assert led.view.state_of(key) is (None if state == "released" else SampleState(state))


def test_a_write_done_for_a_sample_not_granted_is_the_producers_protocol_error() -> None:
    led = ledger(pages=3)
    connected(led, (1, hello()), (2, hello("q")))
    led.credit_request(1, credit("blocker"), 0.0)
    led.credit_request(1, credit("waiting"), 0.0)
    for rid in ("never", "waiting"):
        with pytest.raises(ProtocolError, match="not granted"):
            led.write_done(1, done(led, 1, rid))
        with pytest.raises(ProtocolError, match="not granted"):
            led.late_checksum(1, protocol.LateChecksum(request_id=rid, checksum=1))
    with pytest.raises(ProtocolError, match="not granted"):
        led.write_done(2, done(led, 2, "blocker"))  # another producer's


def test_the_page_size_is_decided_once() -> None:
    led = ledger()
    with pytest.raises(IllegalSampleTransition):
        led.set_pages(PAGE, 3)


# ------------------------------------ hostile credit requests (from the wire)
@st.composite
def hostile_credit_requests(draw: st.DrawFn) -> tuple[bytes, protocol.CreditRequest | None]:
    """Credit requests with out-of-range or inconsistent fields, as bytes; and the
    request the decoder lets through (None when it refuses them)."""
    rid = draw(st.from_regex(r"[A-Za-z0-9_.:@+=\-]{1,24}", fullmatch=True))
    n = draw(st.sampled_from([1, 15, 16, 17, 200, 767, 768, 769, 1 << 17]))
    bs = draw(st.sampled_from([1, LAYOUT.block_size, 1 << 16]))
    m = msgspec.to_builtins(manifest(rid, n, bs))
    nb = m["num_blocks"]
    blocks = list(range(nb))
    what = draw(
        st.sampled_from(
            ["valid", "block_beyond", "duplicate_block", "missing_block", "num_blocks", "dtype", "layout",
             "hidden_size", "token_id", "layer_id", "layer_count"]
        )
    )  # fmt: skip
    if what == "block_beyond":
        blocks.append(nb + draw(st.integers(0, 1 << 20)))
    elif what == "duplicate_block":
        blocks.append(draw(st.sampled_from(blocks)))
    elif what == "missing_block":
        blocks.remove(draw(st.sampled_from(blocks)))
    elif what == "num_blocks":
        m["num_blocks"] = nb + draw(st.sampled_from([-1, 1, 1 << 21])) or 1
    elif what == "dtype":
        m["geometry"]["dtype"] = draw(st.sampled_from(["float64", "int8", "", "torch.float32"]))
    elif what == "layout":
        m["geometry"]["layout"] = draw(st.sampled_from(["HTL", "lth", ""]))
    elif what == "hidden_size":
        m["geometry"]["hidden_size"] = draw(st.sampled_from([0, -1, (1 << 20) + 1, 1 << 20]))
    elif what == "token_id":
        m["token_ids"][-1] = draw(st.sampled_from([-1, 1 << 40, 2**64 - 1]))
    elif what == "layer_id":
        m["layer_ids"][-1] = draw(st.sampled_from([-2, 1 << 16]))
    elif what == "layer_count":
        m["layer_ids"] = [1]
    data = msgspec.msgpack.encode({"type": "credit_request", "manifest": m, "blocks": blocks})
    try:
        msg = protocol.decode(data)
    except ProtocolError:
        return data, None
    assert isinstance(msg, protocol.CreditRequest)
    return data, msg


@settings(max_examples=400, deadline=None)
@given(hostile_credit_requests())
def test_hostile_credit_requests_are_refused_or_granted_and_nothing_leaks(
    case: tuple[bytes, protocol.CreditRequest | None],
) -> None:
    _, req = case
    if req is None:
        return  # the decoder refused it: the reader refuses the connection
    led = ledger(pages=48)
    connected(led, (1, hello()))
    m = req.manifest
    try:
        actions = led.credit_request(1, req, 0.0)
    except ProtocolError as e:
        assert set(req.blocks) != set(range(m.num_blocks)), e  # only an untiled share is refused
        assert led.view.state_of(("p", m.request_id)) in (SampleState.PROMISED, SampleState.GRANTED)
        led.peer_gone(1, 0.0)  # the shell drops the peer: its sample goes
        led.tick(1.0 + led.config.quarantine_s)
        assert led.view.pool is not None and led.view.pool.free_pages == 48 and led.view.pool.waiting == 0
        return
    need = -(-m.geometry.sample_bytes(m.num_blocks) // PAGE)
    if need > 48:
        ((_, r),) = sends(actions, protocol.Refuse)
        assert isinstance(r, protocol.Refuse) and r.code == "pool_too_small"
    else:
        ((_, g),) = sends(actions, protocol.Grant)
        assert isinstance(g, protocol.Grant) and g.num_pages == need and g.first_page + need <= 48


# ------------------------------------------------------- required checksums (R10)
@pytest.mark.parametrize(
    "require, mem, refused",
    [
        (RequireChecksum.AUTO, "DRAM", True),  # hashing a host cache costs its producer little
        (RequireChecksum.AUTO, "VRAM", False),
        (RequireChecksum.ALWAYS, "VRAM", True),
        (RequireChecksum.NEVER, "DRAM", False),
    ],
)
def test_r10_a_share_without_a_checksum_is_refused_where_one_is_required(
    require: RequireChecksum, mem: str, refused: bool
) -> None:
    led = ledger(require_checksum=require)
    connected(led, (1, hello(mem=mem)))
    led.credit_request(1, credit("a"), 0.0)
    actions = led.write_done(1, done(led, 1, "a"), 1.0)
    if refused:
        ((peer, msg),) = sends(actions, protocol.Refuse)
        assert peer == 1 and msg.code == "unchecked" and msg.request_id == "a"
        assert led.view.state_of(("p", "a")) is None and readies(actions) == []
    else:
        assert readies(actions) == [("p", "a")]


def test_r10_a_checksum_that_follows_is_not_a_missing_one() -> None:
    led = ledger(require_checksum=RequireChecksum.ALWAYS)
    connected(led, (1, hello()))
    led.credit_request(1, credit("a"), 0.0)
    actions = led.write_done(1, done(led, 1, "a", checksum_follows=True), 1.0)
    assert sends(actions, protocol.Refuse) == [] and led.view.state_of(("p", "a")) is SampleState.WRITTEN


# --------------------------------------------------------------- deadline (R8)
def test_r8_a_granted_sample_missing_a_rank_is_refused_to_every_rank_at_its_deadline() -> None:
    """TP=2, rank 1 never reaches this reader: rank 0's share landed, the sample can
    never complete. At the deadline both ranks hear of it and the pages come back."""
    led = ledger(pages=4, sample_timeout_s=10.0, quarantine_s=1.0)
    connected(led, (1, hello(rank=0, world=2)), (2, hello(rank=1, world=2)))
    led.credit_request(1, credit("a", rank=0, world=2), 0.0)
    led.credit_request(2, credit("a", rank=1, world=2), 0.5)
    land(led, 1, "a")
    assert led.tick(9.9) == []  # granted at the first rank's request, at 0: not yet
    actions = led.tick(10.1)
    refused = sends(actions, protocol.Refuse)
    assert sorted(p for p, _ in refused) == [1, 2] and all(m.code == "timeout" for _, m in refused)
    assert "ranks [1] missing" in refused[0][1].message
    assert led.view.state_of(("p", "a")) is None
    led.tick(12.0)  # past the quarantine: rank 1 was granted pages and may still WRITE
    led.credit_request(1, credit("b", n=60, rank=0, world=2), 12.0)
    assert led.view.pool is not None and led.view.pool.free_pages < 4
    led.fenced(1, protocol.Fenced(request_id="a", generation=1), 12.1)  # rank 0 owes nothing: moot
    assert led.view.pool.free_pages < 4
    led.fenced(2, protocol.Fenced(request_id="a", generation=1), 12.2)  # no WRITE in flight: free
    assert sends(led.credit_request(2, credit("b", n=60, rank=1, world=2), 12.0), protocol.Grant)


def test_r8_the_wait_for_pages_never_counts() -> None:
    led = ledger(pages=3, sample_timeout_s=10.0)
    connected(led, (1, hello()))
    led.credit_request(1, credit("a"), 0.0)  # takes all 3 pages
    led.credit_request(1, credit("b"), 0.0)  # waits for them
    land(led, 1, "a")
    led.tick(100.0)
    assert led.view.state_of(("p", "b")) is SampleState.PROMISED
    hand_out(led, ("p", "a"), now=100.0)
    led.release(("p", "a"), 100.0)  # b is granted now: its clock starts
    assert led.view.state_of(("p", "b")) is SampleState.GRANTED
    assert sends(led.tick(105.0), protocol.Refuse) == []
    assert [m.code for _, m in sends(led.tick(111.0), protocol.Refuse)] == ["timeout"]


# ------------------------------------------------- fences on dropped pages (R3)
def test_r3_a_dropped_samples_pages_wait_for_each_writer_in_flight_not_for_a_time() -> None:
    """TP=2: rank 0's share landed, rank 1 was granted pages and never wrote. At the
    deadline both are refused; the pages stay held, past any quarantine, until rank 1
    says no WRITE of that grant is in flight (its fence), and go back then."""
    led = ledger(pages=4, sample_timeout_s=10.0, quarantine_s=1.0, fence_bound_s=60.0)
    connected(led, (1, hello(rank=0, world=2)), (2, hello(rank=1, world=2)))
    (g,) = [m for _, m in sends(led.credit_request(1, credit("a", rank=0, world=2), 0.0), protocol.Grant)]
    led.credit_request(2, credit("a", rank=1, world=2), 0.0)
    land(led, 1, "a")
    led.tick(10.1)
    assert led.view.state_of(("p", "a")) is None and led.view.pool is not None
    assert led.view.pool_state().quarantined == g.num_pages
    assert led.tick(30.0) == [] and led.view.pool.free_pages == 4 - g.num_pages  # no fence, no pages
    for rid, gen in (("a", g.generation + 1), ("b", g.generation)):  # not its grant, nor its sample
        assert led.fenced(2, protocol.Fenced(request_id=rid, generation=gen), 30.0) == []
    assert led.view.pool.free_pages == 4 - g.num_pages
    led.fenced(2, protocol.Fenced(request_id="a", generation=g.generation), 30.5)
    assert led.view.pool.free_pages == 4 and led.view.pool_state().quarantined == 0
    # the notification of a WRITE that ended before its fence may come after it: moot
    assert led.write_done(2, protocol.WriteDone(request_id="a", generation=g.generation), 30.6) == []


def test_r3_a_write_done_of_an_older_grant_never_lands_on_the_sample_sent_again() -> None:
    """A sample refused at its deadline and asked for again gets a new grant; the WRITE
    of the old one that lands late neither completes the new sample nor is lost: it
    fences the old pages, which go back."""
    led = ledger(pages=8, sample_timeout_s=10.0)
    connected(led, (1, hello()))
    ((_, old),) = sends(led.credit_request(1, credit("a"), 0.0), protocol.Grant)
    led.tick(10.1)  # never written: refused, its pages wait for rank 0's fence
    ((_, new),) = sends(led.credit_request(1, credit("a"), 11.0), protocol.Grant)
    assert isinstance(old, protocol.Grant) and isinstance(new, protocol.Grant)
    assert new.generation != old.generation and not set(new.pages) & set(old.pages)
    late = protocol.WriteDone(request_id="a", generation=old.generation, checksum=5)
    actions = led.write_done(1, late, 11.5)
    assert readies(actions) == [] and checks(actions) == []
    assert led.view.state_of(("p", "a")) is SampleState.GRANTED  # still waiting for its own WRITE
    assert any(isinstance(a, Log) and "landed after its sample was dropped" in a.text for a in actions)
    # the old pages are back
    assert led.view.pool is not None and led.view.pool.free_pages == 8 - new.num_pages
    assert led.write_done(1, late, 11.6) == []  # a notification of a grant fenced already: moot
    assert readies(land(led, 1, "a")) == [("p", "a")]  # its own WRITE completes it


def test_r3_pages_of_a_departed_writer_wait_a_quarantine() -> None:
    led = ledger(pages=4, sample_timeout_s=10.0, quarantine_s=2.0)
    connected(led, (1, hello(rank=0, world=2)), (2, hello(rank=1, world=2)))
    led.credit_request(1, credit("a", rank=0, world=2), 0.0)
    led.credit_request(2, credit("a", rank=1, world=2), 0.0)
    led.tick(10.1)  # both owe a fence
    led.fenced(1, protocol.Fenced(request_id="a", generation=1), 10.2)
    led.peer_gone(2, 11.0)  # cannot answer any more: its WRITEs settle within the quarantine
    assert led.view.pool is not None and led.view.pool.free_pages < 4
    led.tick(12.9)
    assert led.view.pool.free_pages < 4
    led.tick(13.0)
    assert led.view.pool.free_pages == 4


def test_r3_a_silent_writer_is_waited_for_at_most_the_bound_and_its_late_write_fails_the_new_holder() -> None:
    led = ledger(pages=3, sample_timeout_s=10.0, fence_bound_s=30.0)
    connected(led, (1, hello()))
    ((_, old),) = sends(led.credit_request(1, credit("a"), 0.0), protocol.Grant)
    led.tick(10.1)
    led.credit_request(1, credit("b"), 11.0)  # waits: the pool's pages wait for a's fence
    assert led.view.state_of(("p", "b")) is SampleState.PROMISED
    actions = led.tick(40.2)
    assert any(isinstance(a, Log) and "without a fence" in a.text for a in actions)
    ((_, g),) = sends(actions, protocol.Grant)
    assert isinstance(g, protocol.Grant) and isinstance(old, protocol.Grant) and g.pages == old.pages
    late = protocol.WriteDone(request_id="a", generation=old.generation)
    actions = led.write_done(1, late, 41.0)  # a's WRITE landed after all, in b's pages
    ((_, r),) = sends(actions, protocol.Refuse)
    assert isinstance(r, protocol.Refuse) and r.request_id == "b" and "landed in its pages" in r.message
    assert led.view.state_of(("p", "b")) is None and led.hand_out(("p", "b"), 41.0) is None


# ---------------------------------------------------------------- bounds (R9)
def test_r9_a_sample_over_the_token_limit_is_refused_alone() -> None:
    led = ledger(max_sample_tokens=100)
    connected(led, (1, hello()))
    actions = led.credit_request(1, credit("huge", n=101), 0.0)
    ((_, msg),) = sends(actions, protocol.Refuse)
    assert msg.code == "limit" and msg.request_id == "huge" and "101 tokens" in msg.message
    assert sends(led.credit_request(1, credit("fine", n=100), 0.0), protocol.Grant)


def test_r9_a_rank_over_its_pending_bound_is_dropped_and_frees_its_count_as_it_goes() -> None:
    led = ledger(pages=2, max_pending_per_rank=3)
    connected(led, (1, hello()), (2, hello(pid="q")))
    for rid in "abc":
        led.credit_request(1, credit(rid, n=16), 0.0)
    with pytest.raises(ProtocolError, match="over its bound"):
        led.credit_request(1, credit("d", n=16), 0.0)
    led.credit_request(2, credit("x", n=16), 0.0)  # another producer has its own bound
    land(led, 1, "a")
    hand_out(led, ("p", "a"))  # handed out: no longer pending
    led.credit_request(1, credit("d", n=16), 0.0)
    assert led.view.state_of(("p", "d")) is SampleState.PROMISED


# ------------------------------------------------- the shells' events, counted
def test_the_shells_timings_and_refused_peers_are_counted_by_the_ledger() -> None:
    led = ledger()
    key = written(led)
    (v,) = checks(led.write_done(1, done(led, 1, "a", checksum=5)))  # landed again
    assert led.share_checked(key, 0, 1, True, 0.0, seconds=0.25) == []  # stale: its time still counts
    assert readies(led.share_checked(key, 0, v.landing, True, 0.0, seconds=0.5)) == [key]
    led.values_checked(0.125)
    led.copied(2.0)
    led.copied(1.0)
    led.refused_peer()
    led.refused_peer()
    s = led.stats.snapshot()
    assert (s.verify_s, s.values_check_s, s.copy_s) == (0.75, 0.125, 3.0)
    assert s.refused == 2 and s.samples_refused == 0  # connections, not samples
    assert led.view.pool_state().granted == 3  # nothing else moved


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


# ---------------------------------------------------------------- expectation
def test_a_sample_other_than_expected_is_refused_by_name_before_any_page_is_granted() -> None:
    led = ledger(expect=Expectation(layer_ids=[1, 3], hidden_size=8))
    connected(led, (1, hello()))
    actions = led.credit_request(1, credit("other", n=16), 0.0)
    ((_, msg),) = sends(actions, protocol.Refuse)
    assert msg.code == "mismatch" and msg.request_id == "other"
    assert "layer ids [1, 2], expected [1, 3]" in msg.message
    assert not sends(actions, protocol.Grant)
    assert led.stats.refused_mismatch == 1 and led.stats.samples_refused == 1
    assert led.view.state_of(("p", "other")) is None  # never admitted: nothing held for it
    fine = ledger(expect=Expectation(layer_ids=[1, 2], hidden_size=8, dtype="float32"))
    connected(fine, (1, hello()))
    assert sends(fine.credit_request(1, credit("same", n=16), 0.0), protocol.Grant)
