"""Credits ahead in the reader's ledger (R12 of ``kv_connector.reader.push.ledger``): runs of
pages granted to a producer of one rank before its samples need them, placed samples,
credits given back, recalled, and voided with their holder. Pure: times are passed in."""

from __future__ import annotations

import msgspec
import pytest

from kv_connector.reader.push.ledger import ReaderLedger
from kv_connector.reader.push.records import SampleState
from kv_connector.wire import protocol
from kv_connector.wire.protocol import ProtocolError
from tests.unit.reader.push.helpers import (
    check_all,
    connected,
    credit,
    hand_out,
    hello,
    ledger,
    manifest,
    readies,
    sends,
)


def ahead(pid: str = "p", n: int = 2, world: int = 1, rank: int = 0) -> protocol.Hello:
    return msgspec.structs.replace(hello(pid, rank=rank, world=world), credits_ahead=n)


def placed(rid: str, generation: int, n: int = 40) -> protocol.Placed:
    m = manifest(rid, n)
    return protocol.Placed(manifest=m, blocks=list(range(m.num_blocks)), generation=generation)


def credits_of(actions: list[object], peer: int = 1) -> list[protocol.Credit]:
    return [m for p, m in sends(actions, protocol.Credit) if p == peer]  # type: ignore[misc]


def first_sample(led: ReaderLedger, rid: str = "a", n: int = 40) -> list[protocol.Credit]:
    """Peer 1 (producer "p", one rank, two credits ahead) asks for its first sample the
    usual way: granted, and then given credits sized like it."""
    connected(led, (1, ahead()))
    actions = led.credit_request(1, credit(rid, n), 0.0)
    assert sends(actions, protocol.Grant)
    return credits_of(actions)


def test_r12_a_producer_of_one_rank_gets_credits_sized_like_its_samples_once_it_asked() -> None:
    led = ledger(pages=12)
    got = first_sample(led)  # 3 pages a sample
    assert [c.num_pages for c in got] == [3, 3]
    assert [c.pages for c in got] == [range(3, 6), range(6, 9)]
    assert len({c.generation for c in got} | {led.view.generation_of(("p", "a"))}) == 3  # each its own
    assert led.view.pool is not None and led.view.pool.free_pages == 3
    assert led.credits.pages_held == 6


def test_r12_no_credits_for_a_producer_that_did_not_ask_or_has_more_ranks() -> None:
    led = ledger(pages=12)
    connected(led, (1, hello()), (2, ahead("q", world=2)), (3, ahead("q", world=2, rank=1)))
    assert not sends(led.credit_request(1, credit("a"), 0.0), protocol.Credit)
    tp = led.credit_request(2, credit("b", rank=0, world=2), 0.0)
    tp += led.credit_request(3, credit("b", rank=1, world=2), 0.0)
    assert sends(tp, protocol.Grant) and not sends(tp, protocol.Credit)
    with pytest.raises(ProtocolError, match="does not hold"):
        led.placed(2, placed("c", 99), 0.0)


def test_r12_a_placed_sample_takes_the_credits_first_pages_the_rest_go_back() -> None:
    led = ledger(pages=12)
    c1, _ = first_sample(led)
    assert led.view.pool is not None
    actions = led.placed(1, placed("b", c1.generation, n=20), 1.0)  # 2 of its 3 pages
    assert led.view.state_of(("p", "b")) is SampleState.GRANTED
    assert led.view.generation_of(("p", "b")) == c1.generation
    assert not sends(actions, protocol.Grant)  # no answer: the WRITE is on its way
    # its third page went back, and a credit took its place (two ahead again)
    (again,) = credits_of(actions)
    assert led.credits.pages_held == 6 and again.num_pages == 3
    assert led.view.pool.free_pages == 12 - 3 - 2 - 6  # a, b, and two credits of 3
    wd = protocol.WriteDone(request_id="b", generation=c1.generation, checksum=5)
    assert readies(check_all(led, led.write_done(1, wd, 1.0))) == [("p", "b")]
    hand_out(led, ("p", "b"))
    assert led.release(("p", "b"), 2.0) == []  # two credits held already: none more
    assert led.view.pool.free_pages == 3


def test_r12_a_write_done_that_overtakes_its_placed_lands_when_the_placed_comes() -> None:
    led = ledger(pages=12)
    c1, _ = first_sample(led)
    wd = protocol.WriteDone(request_id="b", generation=c1.generation, checksum=7)
    assert led.write_done(1, wd, 1.0) == []  # kept with its credit
    actions = led.placed(1, placed("b", c1.generation), 1.0)
    assert led.view.state_of(("p", "b")) is SampleState.WRITTEN
    assert readies(check_all(led, actions)) == [("p", "b")]


def test_r12_a_credit_given_back_returns_whole_and_cannot_be_used_again() -> None:
    led = ledger(pages=12)
    c1, _ = first_sample(led)
    assert led.view.pool is not None
    free = led.view.pool.free_pages
    actions = led.credit_returned(1, protocol.CreditReturned(generation=c1.generation), 1.0)
    (again,) = credits_of(actions)  # topped up: two ahead
    assert led.view.pool.free_pages == free + 3 - again.num_pages
    with pytest.raises(ProtocolError, match="does not hold"):
        led.placed(1, placed("b", c1.generation), 1.0)


def test_r12_r7_credits_are_recalled_while_a_sample_waits_and_not_granted_meanwhile() -> None:
    led = ledger(pages=9)
    c1, c2 = first_sample(led)  # 3 + 3 + 3: the pool is full
    connected(led, (2, hello("q")))
    actions = led.credit_request(2, credit("q1"), 0.0)
    assert led.view.state_of(("q", "q1")) is SampleState.PROMISED
    recalls = sends(actions, protocol.CreditRecall)
    assert sorted(m.generation for _, m in recalls) == sorted([c1.generation, c2.generation])  # type: ignore[union-attr]
    assert {p for p, _ in recalls} == {1}
    actions = led.credit_returned(1, protocol.CreditReturned(generation=c2.generation), 1.0)
    assert sends(actions, protocol.Grant) == [(2, sends(actions, protocol.Grant)[0][1])]
    assert led.view.state_of(("q", "q1")) is SampleState.GRANTED
    assert not credits_of(actions)  # none while a sample waited; none fit now
    # the producer had placed its first credit already: the recall is answered by that
    led.placed(1, placed("b", c1.generation), 1.0)
    assert led.view.state_of(("p", "b")) is SampleState.GRANTED


def test_r12_r3_a_credits_pages_wait_for_the_fence_of_a_sample_refused_as_placed() -> None:
    led = ledger(pages=12, max_sample_tokens=40)
    c1, _ = first_sample(led, n=40)
    actions = led.placed(1, placed("b", c1.generation, n=41), 1.0)  # over the limit, still 3 pages
    refused = sends(actions, protocol.Refuse)
    assert refused and refused[0][1].code == "limit"  # type: ignore[union-attr]
    assert led.view.state_of(("p", "b")) is None
    assert led.view.pool_state().quarantined == 3  # its WRITE may still land: the pages wait
    led.fenced(1, protocol.Fenced(request_id="b", generation=c1.generation), 2.0)
    assert led.view.pool_state().quarantined == 0
    s = led.view.pool_state()
    assert s.free + s.granted + s.leased == s.num_pages


def test_r12_s11_a_placed_sample_the_producer_refuses_after_its_placed_frees_its_pages_at_the_fence() -> None:
    """The order the sender keeps (its S11): Placed, then its Refuse, then its Fenced."""
    led = ledger(pages=12)
    c1, _ = first_sample(led)
    led.placed(1, placed("b", c1.generation), 1.0)
    before = led.view.pool_state()
    led.producer_refused(1, protocol.Refuse(code="preempted", message="preempted", request_id="b"), 1.5)
    assert led.view.state_of(("p", "b")) is None
    assert led.view.pool_state().free == before.free  # its WRITE may still land: not free yet
    led.fenced(1, protocol.Fenced(request_id="b", generation=c1.generation), 2.0)
    s = led.view.pool_state()
    assert s.quarantined == 0 and s.free > before.free
    assert s.free + s.granted + s.leased == s.num_pages


def test_r12_r4_a_delivered_sample_placed_again_is_acked_and_its_credit_freed_when_it_lands() -> None:
    led = ledger(pages=12, already_delivered=lambda pid, rid: rid == "old")
    c1, _ = first_sample(led)
    actions = led.placed(1, placed("old", c1.generation), 1.0)
    assert sends(actions, protocol.Ack) == [(1, protocol.Ack(request_id="old"))]
    assert led.view.state_of(("p", "old")) is None and led.view.pool_state().quarantined == 3
    led.write_done(1, protocol.WriteDone(request_id="old", generation=c1.generation, checksum=1), 2.0)
    assert led.view.pool_state().quarantined == 0


def test_r12_a_credit_whose_holder_left_waits_a_quarantine() -> None:
    led = ledger(pages=12, quarantine_s=5.0)
    first_sample(led)
    assert led.view.pool is not None
    led.peer_gone(1, 10.0)
    assert led.credits.pages_held == 0 and led.view.pool_state().quarantined == 6
    led.tick(14.0)  # its sample "a" is discarded too, its pages quarantined from now
    assert led.view.pool_state().quarantined == 6 + 3
    led.tick(15.5)  # the credits' quarantine is over
    assert led.view.pool_state().quarantined == 3


@pytest.mark.parametrize(
    ("why", "msg"),
    [("too big", "needs 4 pages"), ("asked before", "asked for before")],
)
def test_r12_a_placed_sample_that_does_not_fit_its_credit_is_the_producers_protocol_error(
    why: str, msg: str
) -> None:
    led = ledger(pages=12, quarantine_s=5.0)
    c1, _ = first_sample(led)
    bad = placed("big", c1.generation, n=60) if why == "too big" else placed("a", c1.generation)
    with pytest.raises(ProtocolError, match=msg):
        led.placed(1, bad, 1.0)
    assert led.view.pool_state().quarantined == 3  # its WRITE may land: a quarantine, then back
