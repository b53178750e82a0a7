"""The pull ledger as a state machine: its invariants P1-P8 (each test names the one it
proves), the pull handle's encoding, the pull messages' validation, and the pull options.
Pure: no transport, no sockets, no threads; times are passed in."""

from __future__ import annotations

import msgspec
import pytest

from kv_connector.producer.options import ConnectorOptions, Delivery, pull_endpoint
from kv_connector.producer.pull.ledger import HoldState, IllegalTransition, PullLedger, PullRefused
from kv_connector.wire import protocol
from kv_connector.wire.handle import HandleError, PullHandle, decode_handle, make_nonce
from tests.unit.producer.helpers import LAYOUT, held, manifest


def code_of(fn: object, *args: object) -> str:
    with pytest.raises(PullRefused) as e:
        fn(*args)  # type: ignore[operator]
    return e.value.code


def test_p1_data_only_while_held_then_the_reason_it_ended() -> None:
    led = PullLedger(timeout_s=10)
    held(led, "r1")
    h = led.fetch("r1", "a" * 32, 1.0)
    assert h.block_ids == [10, 11, 12] and h.share == range(3) and led.served == 1
    led.release("r1", "a" * 32, 2.0)
    assert code_of(led.fetch, "r1", "a" * 32, 2.0) == "released"
    assert code_of(led.release, "r1", "a" * 32, 2.0) == "released"
    for end, code in ((led.preempt, "preempted"), (led.abort, "aborted")):
        held(led, "r2")
        assert end(["r2", "never-held"]) == ["r2"]
        assert code_of(led.fetch, "r2", "a" * 32, 3.0) == code
    held(led, "r3")
    assert led.close() == ["r3"] and code_of(led.fetch, "r3", "a" * 32, 3.0) == "closed"
    led.fail("r4", "b" * 32, "could not be captured: slots")
    assert code_of(led.fetch, "r4", "b" * 32, 3.0) == "failed"


def test_p2_a_wrong_nonce_is_answered_as_an_unknown_request() -> None:
    led = PullLedger(timeout_s=10)
    held(led, "r1")
    assert code_of(led.fetch, "r1", "b" * 32, 1.0) == "unknown"
    assert code_of(led.fetch, "nope", "a" * 32, 1.0) == "unknown"
    assert code_of(led.release, "r1", "b" * 32, 1.0) == "unknown"
    assert led.is_held("r1")  # a forged release freed nothing
    led.release("r1", "a" * 32, 1.0)
    assert code_of(led.fetch, "r1", "b" * 32, 1.0) == "unknown"  # ended: still nothing for a wrong nonce


def test_p3_every_hold_is_freed_exactly_once_whatever_ends_it() -> None:
    led = PullLedger(timeout_s=5)
    for rid in ("a", "b", "c", "d", "e"):
        held(led, rid)
    assert led.held_blocks() == 15
    led.release("a", "a" * 32, 1.0)
    led.preempt(["b"])
    led.abort(["c"])
    assert led.take_freed() == {"a", "b", "c"}
    assert led.expire(6.0) == ["d", "e"]
    led.preempt(["d"])  # ended already: nothing more
    assert led.take_freed() == {"d", "e"} and led.take_freed() == set() and len(led) == 0


def test_p4_the_clock_runs_from_the_requests_finish_not_from_its_capture() -> None:
    led = PullLedger(timeout_s=5)
    m = manifest("r1")
    led.hold("r1", "a" * 32, m, [1, 2, 3], range(3), 0.0)  # captured at its prompt's end
    assert led.expire(1000.0) == [] and led.fetch("r1", "a" * 32, 1000.0).request_id == "r1"
    led.finished(["r1", "unknown"], 1000.0)  # a long generation later
    led.finished(["r1"], 1003.0)  # reported again: the clock does not restart
    assert led.expire(1004.9) == [] and led.expire(1005.0) == ["r1"]


def test_p4_a_sample_past_its_deadline_is_never_served_even_before_expire_runs() -> None:
    led = PullLedger(timeout_s=5)
    held(led, "r1", t=100.0)
    assert led.fetch("r1", "a" * 32, 104.9).request_id == "r1"
    assert code_of(led.fetch, "r1", "a" * 32, 105.0) == "expired"
    assert led.take_freed() == {"r1"} and led.expire(200.0) == []


def test_p5_what_is_remembered_of_ended_samples_is_bounded() -> None:
    led = PullLedger(timeout_s=5, remember=3)
    for i in range(5):
        held(led, f"r{i}")
        led.release(f"r{i}", "a" * 32, 0.0)
    assert code_of(led.fetch, "r0", "a" * 32, 0.0) == "unknown"  # forgotten
    assert code_of(led.fetch, "r4", "a" * 32, 0.0) == "released"


def test_p6_a_request_is_held_once_at_a_time() -> None:
    led = PullLedger(timeout_s=5)
    held(led, "r1")
    with pytest.raises(IllegalTransition):
        held(led, "r1")
    led.release("r1", "a" * 32, 0.0)
    held(led, "r1", nonce="c" * 32)  # a new life (a new nonce) after it ended
    assert led.fetch("r1", "c" * 32, 0.0).nonce == "c" * 32
    assert {s.value for s in HoldState} >= {"held", "expired", "released"}


def test_p8_a_consumer_that_is_coming_keeps_the_hold_within_a_bound() -> None:
    led = PullLedger(timeout_s=10)
    held(led, "r1", t=0.0)
    assert led.keep("r1", "a" * 32, 8.0) == 10.0  # held 10 s from now, not 2
    assert led.fetch("r1", "a" * 32, 17.0).keeps == 1  # past its first deadline: still served
    assert led.keep("r1", "a" * 32, 15.0) == 5.0  # at most 2 x 10 s after its finish
    assert led.keep("r1", "a" * 32, 19.5) == pytest.approx(0.5)
    assert led.expire(19.9) == [] and led.expire(20.0) == ["r1"]
    assert code_of(led.keep, "r1", "a" * 32, 20.0) == "expired"  # the bound holds: no data after


def test_p8_a_keep_never_shortens_a_hold_or_starts_a_clock_and_needs_the_nonce() -> None:
    led = PullLedger(timeout_s=10)
    held(led, "r1", t=0.0)
    led.keep("r1", "a" * 32, 9.0)  # deadline 19
    assert led.keep("r1", "a" * 32, 1.0) == 18.0  # an older keep moves nothing back
    assert code_of(led.keep, "r1", "x" * 32, 1.0) == "unknown"  # P2: a wrong nonce keeps nothing
    m = manifest("r2")
    led.hold("r2", "b" * 32, m, [1, 2, 3], range(3), 0.0)  # its request still runs
    assert led.keep("r2", "b" * 32, 100.0) == 10.0
    assert led.expire(1000.0) == ["r1"]  # r2's clock has not started
    led.finished(["r2"], 2000.0)
    assert led.expire(2009.9) == [] and led.expire(2010.0) == ["r2"]


def test_a_handle_round_trips_and_anything_else_is_a_handle_error() -> None:
    h = PullHandle("vllm-abc", "cmpl-1-0", make_nonce(), ["127.0.0.1:5000", "[::1]:5001"])
    text = h.encode()
    assert decode_handle(text) == h and text.startswith("kvhs1.") and len(text) < 200
    for bad in (None, 5, "", "kvhs1.", "kvhs1.!!!", "kvhs2." + text[6:], text[:-4], text + "x"):
        with pytest.raises(HandleError):
            decode_handle(bad)
    forged = msgspec.msgpack.encode(["p", "r", "not-hex", ["127.0.0.1:1"]])
    import base64

    with pytest.raises(HandleError):
        decode_handle("kvhs1." + base64.urlsafe_b64encode(forged).decode())
    with pytest.raises(ValueError):
        PullHandle("p", "r", make_nonce(), ["no-port"])


def test_a_share_must_be_its_ranks_stripe_and_inside_the_cache() -> None:
    m = manifest("r1", 40)  # 3 blocks: rank 0 of 2 serves blocks 0-1, rank 1 block 2
    ok = dict(manifest=m, rank=1, world_size=2, first_block=2, block_ids=[7], cache_addr=4096,
              cache_bytes=8 * LAYOUT.block_bytes, mem_type="DRAM", device_id=0)  # fmt: skip
    share = protocol.PullShare(**ok)  # type: ignore[arg-type]
    assert protocol.decode(protocol.encode(share)) == share
    for bad in (dict(first_block=1), dict(block_ids=[7, 8]), dict(block_ids=[8]), dict(rank=2)):
        with pytest.raises((ValueError, msgspec.ValidationError)):
            protocol.PullShare(**{**ok, **bad})  # type: ignore[arg-type]
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(protocol.encode(protocol.PullFetch(request_id="r", nonce="a" * 32))[:-3])
    assert protocol.PROTOCOL_VERSION == 17
    keep = protocol.PullKeep(request_id="r", nonce="a" * 32)
    kept = protocol.PullKept(request_id="r", held_s=12.5)
    assert protocol.decode(protocol.encode(keep)) == keep and protocol.decode(protocol.encode(kept)) == kept
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(msgspec.msgpack.encode({"type": "pull_kept", "request_id": "r", "held_s": -1.0}))


def test_pull_options_need_no_reader_and_refuse_push_only_keys() -> None:
    opts = ConnectorOptions.parse({"delivery": "pull"})
    assert opts.delivery is Delivery.PULL and opts.pull.listen == "127.0.0.1"
    assert opts.pull.timeout_s == 300.0 and opts.push.readers == ()
    assert ConnectorOptions.parse({"delivery": "pull", "pull_timeout_s": 2}).pull.timeout_s == 2.0
    push = ConnectorOptions.parse({"consumer_address": "127.0.0.1:1"})
    assert push.delivery is Delivery.PUSH  # push stays the default
    for bad, match in (
        ({"consumer_address": "127.0.0.1:1"}, "push"),
        ({"pull_timeout_s": 0}, "pull_timeout_s"),
        ({"pull_listen": "h:x"}, "pull_listen"),
    ):
        with pytest.raises(ValueError, match=match):
            ConnectorOptions.parse({"delivery": "pull", **bad})
    with pytest.raises(ValueError, match="delivery"):
        ConnectorOptions.parse({"delivery": "carrier pigeon"})
    # output tokens are held in the step after the response: fetches wait for them
    assert ConnectorOptions.parse({"delivery": "pull", "include_output_tokens": True}).include_output_tokens
    assert pull_endpoint("127.0.0.1", 3) == ("127.0.0.1", 0)
    assert pull_endpoint("10.0.0.1:7000", 2) == ("10.0.0.1", 7002)
    assert pull_endpoint("::1", 0) == ("::1", 0) and pull_endpoint("[::1]:9", 1) == ("::1", 10)
