"""S11 of ``kv_connector.sender.ledger`` in the sender's loop: what the reader hears of a
job that fails on another thread (a preemption on the engine's) while the loop is about to
send the job's ``Placed`` or ``CreditRequest`` never goes out before that message.

Otherwise the reader reads the job's ``Refuse`` and ``Fenced`` first, then admits the
sample from its late message, and holds its pages for a WRITE that never comes until the
sample deadline. The loop runs no thread here: its sending step is called directly, on a
connection that records the order of the messages and lets the job fail at the instant
before one of them leaves (pure logic; the real transfers are the integration tests')."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kv_connector.sender.config import SenderConfig
from kv_connector.sender.ledger import SendLedger
from kv_connector.sender.loop import LoopParts, SenderLoop
from kv_connector.wire import handshake, protocol
from kv_connector.wire.failure import FailureReason
from tests.unit.sender.helpers import PAGE, credit, held, ledger, submit


class _Writer:
    """What the loop's sending step touches of the WRITE path."""

    page_bytes = PAGE

    def __init__(self) -> None:
        self.wakes = 0

    def wake(self) -> None:
        self.wakes += 1

    def adopt(self, xfer: object, settled: Callable[[], None] | None) -> None:
        raise AssertionError("no WRITE was posted in these tests")


class _Wire:
    """A control connection that records what is sent; ``before`` runs once, just before the
    first message of type ``kind`` leaves (as another thread would, at that instant)."""

    def __init__(self, kind: type, before: Callable[[], None]) -> None:
        self.sent: list[protocol.Message] = []
        self._kind, self._before = kind, before

    def send(self, msg: protocol.Message) -> None:
        if isinstance(msg, self._kind) and self._before is not None:
            before, self._before = self._before, None  # type: ignore[assignment]
            before()
        self.sent.append(msg)


def _loop(led: SendLedger, lock: threading.Lock) -> SenderLoop:
    me = handshake.ProducerIdentity("p", 0, 1, "p-r0", PAGE)
    config = SenderConfig("127.0.0.1:1", "p", checksum=None)
    return SenderLoop(config, me, None, LoopParts(object(), led, lock, _Writer()))  # type: ignore[arg-type]


def _fail_on_engine_thread(
    loop: SenderLoop, led: SendLedger, lock: threading.Lock, rid: str
) -> Callable[[], None]:
    """The engine thread's preemption of ``rid``: the ledger fails it, then the reader is told."""

    def fail() -> None:
        with lock:
            failure = led.fail(rid, "preempted", FailureReason.PREEMPTED, code="preempted")
        assert failure is not None
        loop.tell_reader(failure)

    return fail


def _kinds(wire: _Wire) -> list[str]:
    return [type(m).__name__ for m in wire.sent]


def test_s11_a_placed_job_failed_before_its_placed_left_is_refused_and_fenced_after_it() -> None:
    led, lock = ledger(), threading.Lock()
    loop = _loop(led, lock)
    held(led, credit(9))
    submit(led, "a")
    wire = _Wire(protocol.Placed, _fail_on_engine_thread(loop, led, lock, "a"))
    loop.attach(wire)  # type: ignore[arg-type]
    loop.send_requests()
    assert _kinds(wire) == ["Placed", "Refuse", "Fenced"]
    placed, refuse, fenced = wire.sent
    assert isinstance(placed, protocol.Placed) and placed.generation == 9
    assert isinstance(refuse, protocol.Refuse) and refuse.request_id == "a" and refuse.code == "preempted"
    assert isinstance(fenced, protocol.Fenced) and fenced.generation == 9
    assert led.announced(["a"]) == []  # nothing left parked


def test_s11_a_requested_job_failed_before_its_request_left_is_refused_after_it() -> None:
    led, lock = ledger(), threading.Lock()
    loop = _loop(led, lock)
    submit(led, "a")
    submit(led, "b")
    wire = _Wire(protocol.CreditRequest, _fail_on_engine_thread(loop, led, lock, "a"))
    loop.attach(wire)  # type: ignore[arg-type]
    loop.send_requests()
    assert _kinds(wire) == ["CreditRequest", "CreditRequest", "Refuse"]
    assert [getattr(m, "manifest", m).request_id for m in wire.sent] == ["a", "b", "a"]  # type: ignore[union-attr]


def test_s11_a_failure_after_the_message_left_is_told_at_once() -> None:
    led, lock = ledger(), threading.Lock()
    loop = _loop(led, lock)
    held(led, credit(4))
    submit(led, "a")
    wire = _Wire(protocol.Refuse, lambda: None)
    loop.attach(wire)  # type: ignore[arg-type]
    loop.send_requests()
    _fail_on_engine_thread(loop, led, lock, "a")()
    assert _kinds(wire) == ["Placed", "Refuse", "Fenced"]


def test_s11_a_lost_connection_still_hands_back_what_was_parked() -> None:
    led, lock = ledger(), threading.Lock()
    loop = _loop(led, lock)
    submit(led, "a")
    told: list[str] = []
    fail = _fail_on_engine_thread(loop, led, lock, "a")

    class _Gone(_Wire):
        def send(self, msg: protocol.Message) -> None:
            if isinstance(msg, protocol.CreditRequest):
                fail()
                raise OSError("connection reset")
            told.append(type(msg).__name__)  # what is told after it: the Refuse, on the dead link

    loop.attach(_Gone(protocol.CreditRequest, lambda: None))  # type: ignore[arg-type]
    try:
        loop.send_requests()
    except OSError:
        pass
    else:
        raise AssertionError("the send's error reaches the loop, which drops the connection")
    assert told == ["Refuse"] and led.announced(["a"]) == []
