"""The step barrier and the slot-mapping check off the step's critical path
(``producer.slot_check``): nothing is checked, and no gate opens, before the step's event
is done; steps are checked in order, whoever asks; a request whose slots disagree with
its block table fails by name, once. Here the steps run on the host: the stand-in event
is made to say "not done" until the test lets it."""

from __future__ import annotations

import pytest
import torch

from kv_connector.producer import slot_check
from kv_connector.producer.planning import BlockRecorder, StepSlice, StepSlots

BS = 4


@pytest.fixture
def device_busy(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """busy[0]: the stand-in events say their step is still running."""
    busy = [True]
    monkeypatch.setattr(slot_check.HostDone, "query", lambda self: not busy[0])
    return busy


def _slots(table: list[int], start: int, n: int) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in range(start, start + n)]


def test_nothing_is_checked_before_the_step_is_done(device_busy: list[bool]) -> None:
    rec, checks = BlockRecorder(BS), slot_check.SlotChecks(BS)
    sl = StepSlice("r", 0, 6, (7, 3))
    planned, errors = rec.slots_of([sl])
    assert errors == {}
    wrong = torch.tensor([x + 1 for x in _slots([7, 3], 0, 6)])  # every slot one off
    gate = checks.add(wrong, planned)
    assert gate.poll("r") == (False, None)
    assert checks.settle() == {}
    device_busy[0] = False
    done, why = gate.poll("r")
    assert done and why == "positions 0..5 were not written where the block table puts them with block size 4"
    assert checks.settle() == {"r": why}  # reported once
    assert checks.settle() == {}
    checks.forget("r")
    assert gate.poll("r") == (True, None)


def test_steps_are_checked_in_order_and_a_gate_sees_earlier_failures(device_busy: list[bool]) -> None:
    rec, checks = BlockRecorder(BS), slot_check.SlotChecks(BS)
    # step 1 writes the first chunk of r at the wrong block; step 2 the rest, correctly
    e1, _ = rec.slots_of([StepSlice("r", 0, 4, (5, 6))])
    g1 = checks.add(torch.tensor(_slots([9], 0, 4)), e1)
    e2, _ = rec.slots_of([StepSlice("r", 4, 3, (), blocks_from=2)])
    g2 = checks.add(torch.tensor(_slots([5, 6], 4, 3)), e2)
    assert g2.poll("r") == (False, None)  # step 1 not done: step 2 is not checked before it
    device_busy[0] = False
    done, why = g2.poll("r")
    assert done and why == "positions 0..3 were not written where the block table puts them with block size 4"
    assert g1.poll("r") == (True, why)


def test_a_correct_step_opens_its_gate_and_a_step_without_slots_is_a_barrier_only(
    device_busy: list[bool],
) -> None:
    rec, checks = BlockRecorder(BS), slot_check.SlotChecks(BS)
    planned, _ = rec.slots_of([StepSlice("a", 2, 5, (1, 8))])
    gate = checks.add(torch.tensor([-1, *_slots([1, 8], 2, 5)]), planned)  # a padded row first
    barrier = checks.add(None, StepSlots())
    device_busy[0] = False
    assert gate.poll("a") == (True, None)
    assert barrier.poll("a") == (True, None)
    assert checks.settle() == {}


def test_on_the_host_a_step_is_checked_at_once() -> None:
    rec, checks = BlockRecorder(BS), slot_check.SlotChecks(BS)
    planned, _ = rec.slots_of([StepSlice("a", 0, 6, (2, 5))])
    gate = checks.add(torch.tensor(_slots([2, 4], 0, 6)), planned)
    assert checks.settle() == {"a": "block 1 was written to cache block 4, the block table says 5"}
    assert gate.poll("a")[0]


@pytest.mark.parametrize(
    "wrong",
    ["other-block", "other-offset", "padding", "neighbour-slot", "long-later-block"],
)
def test_one_wrong_slot_among_many_decoding_requests_is_found_and_named(
    device_busy: list[bool], wrong: str
) -> None:
    """256 requests decoding (one position each, some starting a new block this step) and
    one longer slice, in a shuffled slot mapping: exactly the request written to the
    wrong place fails, with the words ``check_slots`` uses."""
    rec, checks = BlockRecorder(BS), slot_check.SlotChecks(BS)
    tables = {f"r{i}": [3 * i + 1, 3 * i + 2] for i in range(256)}
    rec.slots_of([StepSlice(rid, 0, 1, (t[0],)) for rid, t in tables.items()])  # block 0 sent before
    pos = {rid: 2 + (i % 3) for i, rid in enumerate(tables)}  # position 4 starts block 1, sent now
    new_block = {rid: (t[1],) if pos[rid] == 4 else () for rid, t in tables.items()}
    slices = [StepSlice(rid, pos[rid], 1, new_block[rid], blocks_from=1) for rid in tables]
    long_table = [900, 901, 902]
    slices.append(StepSlice("long", 2, 7, tuple(long_table)))
    rows = {rid: [t[pos[rid] // BS] * BS + pos[rid] % BS] for rid, t in tables.items()}
    rows["long"] = _slots(long_table, 2, 7)
    victim, why = "r100", "positions 3..3 were not written where the block table puts them with block size 4"
    if wrong == "other-block":
        rows[victim] = [777 * BS]
    elif wrong == "other-offset":
        rows[victim] = [rows[victim][0] + 1]
    elif wrong == "padding":
        rows[victim] = [-1]
    elif wrong == "neighbour-slot":  # the very slot another request (at position 3 too) wrote
        rows[victim] = list(rows["r1"])
    else:
        victim, why = "long", "block 1 was written to cache block 903, the block table says 901"
        rows["long"] = _slots([900, 903, 902], 2, 7)
    order = sorted(rows, key=lambda rid: hash((rid, wrong)))
    flat = torch.tensor([-1, *(x for rid in order for x in rows[rid]), -1])
    planned, errors = rec.slots_of(slices)
    assert errors == {} and len(planned) == 257
    gate = checks.add(flat, planned)
    device_busy[0] = False
    news = checks.settle()
    assert set(news) == {victim}
    assert news[victim] == why
    assert gate.poll(victim) == (True, why)
    assert all(gate.poll(rid) == (True, None) for rid in tables if rid not in news)


def test_a_sample_is_checked_against_the_input_ids_its_positions_were_computed_from(
    device_busy: list[bool],
) -> None:
    """Two requests in a step, rows interleaved by the batch; a decode step recomputes a
    position; the ship's token ids are compared once the last step is checked."""
    rec, checks = BlockRecorder(BS), slot_check.SlotChecks(BS)
    a, b = [11, 12, 13, 14, 15], [21, 22, 23]
    e1, _ = rec.slots_of([StepSlice("b", 0, 3, (2,)), StepSlice("a", 0, 5, (5, 6))])
    slots = _slots([2], 0, 3) + _slots([5, 6], 0, 5) + [-1, -1]  # padded rows
    g1 = checks.add(torch.tensor(slots), e1, torch.tensor(b + a + [0, 0, 99], dtype=torch.int32))
    e2, errors = rec.slots_of([StepSlice("a", 5, 1, (), blocks_from=2)])
    assert errors == {} and e2
    g2 = checks.add(torch.tensor(_slots([5, 6], 5, 1)), e2, torch.tensor([16, 77], dtype=torch.int32))
    checks.compare_tokens("a", (*a, 16), g2.seq)
    checks.compare_tokens("a2", (1,), g2.seq)  # nothing of it was computed: nothing to compare
    checks.compare_tokens("b", (21, 22, 24), g1.seq)  # position 2 was computed from 23
    assert g2.poll("a") == (False, None)
    device_busy[0] = False
    assert g2.poll("a") == (True, None)
    done, why = g1.poll("b")
    assert done and why is not None and why.startswith("token check: 1 position(s)")
    assert "2 from 23 (ships 24)" in why
    # a position recomputed later counts with its last input (the row the cache holds)
    e3, _ = rec.slots_of([StepSlice("c", 0, 2, (8,))])
    g3 = checks.add(torch.tensor(_slots([8], 0, 2)), e3, torch.tensor([30, 31], dtype=torch.int32))
    e4, _ = rec.slots_of([StepSlice("c", 1, 1, (), blocks_from=1)])
    g4 = checks.add(torch.tensor(_slots([8], 1, 1)), e4, torch.tensor([32], dtype=torch.int32))
    checks.compare_tokens("c", (30, 32), g4.seq)  # registered after the step was checked
    assert g3.poll("c") == (True, None) and g4.poll("c") == (True, None)
    checks.compare_tokens("c", (30, 31), g4.seq)  # its inputs were compared (and dropped) already
    assert g4.poll("c") == (True, None)


def test_without_input_ids_nothing_is_compared(device_busy: list[bool]) -> None:
    rec, checks = BlockRecorder(BS), slot_check.SlotChecks(BS)
    e1, _ = rec.slots_of([StepSlice("a", 0, 2, (1,))])
    g = checks.add(torch.tensor(_slots([1], 0, 2)), e1)
    checks.compare_tokens("a", (5, 6), g.seq)
    device_busy[0] = False
    assert g.poll("a") == (True, None)
