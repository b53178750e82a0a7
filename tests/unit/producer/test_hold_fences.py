"""Hold fences (``producer.pull.hold_fences``) and the ledger's P7: a hold's fence word holds
its value exactly while it is held, zeroed in the call that ends it."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kv_connector.producer.pull.hold_fences import FenceTable
from kv_connector.producer.pull.ledger import PullLedger
from kv_connector.wire import protocol
from tests.unit.producer.helpers import held


def table(n: int = 8, first: int | None = None) -> FenceTable:
    return FenceTable(np.full(n, 7, dtype=np.uint64), first)


def test_each_hold_gets_a_slot_and_a_value_never_seen_before() -> None:
    t = table(4, first=100)
    opened = [t.open() for _ in range(4)]
    assert [v for _, v in opened] == [100, 101, 102, 103]  # type: ignore[misc]
    assert sorted(s for s, _ in opened) == [0, 1, 2, 3]  # type: ignore[misc]
    assert t.open() is None and t.open_slots == 4  # full: no fence, nothing overwritten
    slot, _ = opened[1]  # type: ignore[misc]
    t.close(slot)
    assert t.words[slot] == 0 and t.open_slots == 3
    again = t.open()
    assert again == (slot, 104)  # the same slot, a new value: an old share's READ sees a change
    t.close(slot)
    with pytest.raises(ValueError):
        t.close(slot)  # closed twice: the ledger's bug, never a silent free slot handed out twice


def test_a_table_starts_closed_and_values_start_at_random() -> None:
    a, b = table(), table()
    assert not a.words.any()
    va, vb = a.open(), b.open()
    assert va is not None and vb is not None and va[1] != vb[1] and va[1] > 0
    with pytest.raises(ValueError):
        FenceTable(np.zeros(4, dtype=np.int64))


def test_p7_the_word_holds_the_value_exactly_while_held_whatever_ends_it() -> None:
    t = table(16)
    led = PullLedger(timeout_s=5, fences=t)
    rids = ["rel", "pre", "abo", "exp", "clo"]
    for rid in rids:
        held(led, rid)
    fences = {rid: led.holding(rid).fence for rid in rids}  # type: ignore[union-attr]
    assert all(f is not None and t.words[f[0]] == f[1] for f in fences.values())
    assert len({f[0] for f in fences.values()}) == len(rids)  # type: ignore[index]

    def live(rid: str) -> bool:
        slot, value = fences[rid]  # type: ignore[misc]
        return bool(t.words[slot] == value)

    led.release("rel", "a" * 32, 1.0)
    led.preempt(["pre"])
    led.abort(["abo"])
    assert [live(r) for r in rids] == [False, False, False, True, True]
    led.expire(6.0)  # the deadline passed: zeroed before take_freed reports it
    assert not live("exp") and "exp" in led.take_freed()
    led.close()
    assert not any(live(r) for r in rids) and t.open_slots == 0


def test_a_full_table_holds_without_a_fence() -> None:
    led = PullLedger(timeout_s=5, fences=table(1))
    held(led, "a")
    held(led, "b")
    assert led.holding("a").fence is not None and led.holding("b").fence is None  # type: ignore[union-attr]
    led.release("b", "a" * 32, 1.0)  # ends without touching a's word
    assert led.holding("a").fence is not None  # type: ignore[union-attr]


def test_a_fence_on_the_wire_is_one_word_of_its_table() -> None:
    ok = dict(table_addr=4096, table_bytes=64, offset=56, value=1 << 62)
    f = protocol.HoldFence(**ok)  # type: ignore[arg-type]

    def decoded(d: dict[str, int]) -> protocol.HoldFence:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=protocol.HoldFence)

    assert decoded(ok) == f
    for bad in (dict(offset=60), dict(offset=64), dict(value=0), dict(table_addr=(1 << 64) - 32)):
        with pytest.raises((ValueError, msgspec.ValidationError)):
            decoded({**ok, **bad})
    release = protocol.PullRelease(request_id="r", nonce="a" * 32)
    assert release.answer and protocol.decode(protocol.encode(release)) == release
