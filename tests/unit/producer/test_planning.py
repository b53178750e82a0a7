"""What to ship and when: ShipPlanner (scheduler side) and BlockRecorder (worker side).

Pure logic: these tests import neither vllm, nixl nor torch. Requests are driven the way
vLLM's scheduler reports them: a request's first scheduled step comes as a NewRequest
(with its whole block table so far), later steps as a Running tuple (with the blocks added
in that step, or the whole new table when resumed after preemption), and
``num_scheduled`` gives the positions computed in the step, starting at
``num_computed_tokens``.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_connector.producer.delivery import DeliveryBook
from kv_connector.producer.options import ConnectorOptions
from kv_connector.producer.planning import (
    BlockRecorder,
    NewRequest,
    Running,
    ShipOrder,
    ShipPlanner,
    SlotMismatch,
    StepPlan,
    StepSlice,
    check_slots,
    check_step,
)
from kv_connector.producer.push.admission import Router
from kv_connector.producer.push.mode import PushScheduling
from kv_connector.producer.request_table import RequestTable
from kv_connector.producer.worker_report import LinkChange, WorkerReport

BS = 16  # block size of the simulated scheduler and cache


def nblocks(num_tokens: int, bs: int = BS) -> int:
    return -(-num_tokens // bs)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


class BlockPool:
    """Hands out scattered cache block ids, never the same one twice."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._used: set[int] = set()

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            b = self._rng.randrange(1, 1 << 20)
            if b not in self._used:
                self._used.add(b)
                out.append(b)
        return out


def running(
    rid: str, computed: int, new_blocks: list[int] | None = None, resumed: bool = False
) -> Running:
    return (rid, new_blocks, resumed, computed)


def slots_for(table: tuple[int, ...] | list[int], start: int, n: int, bs: int = BS) -> list[int]:
    """The slots a cache of block size ``bs`` writes for positions start..start+n-1."""
    return [table[p // bs] * bs + p % bs for p in range(start, start + n)]


# =============================================================== ShipPlanner


@pytest.mark.parametrize("length", [1, BS, BS + 1, 7 * BS + 5], ids=["1", "one-block", "block+1", "many"])
def test_prompt_ships_once_in_the_step_that_computes_its_last_token(length: int) -> None:
    pool, planner = BlockPool(), ShipPlanner()
    prompt = prompt_of(length)
    table = pool.take(nblocks(length))
    planner.add("r")

    plan = planner.plan([NewRequest("r", prompt, table, 0)], [], {"r": length})
    assert plan.slices == [StepSlice("r", 0, length, tuple(table))]
    assert plan.ships == [ShipOrder("r", tuple(prompt), tuple(table))]
    assert plan.resets == []
    assert planner.is_shipping("r")

    # Three decode steps (the last with a speculative token): nothing more to do.
    computed = length
    for n in (1, 1, 2):
        grow = pool.take(1) if computed % BS == 0 else None
        table += grow or []
        later = planner.plan([], [running("r", computed, grow)], {"r": n})
        assert later.slices == [] and later.ships == [] and not later
        computed += n

    assert planner.finish("r", [*prompt, 5, 6, 7, 8], table) is True
    assert len(planner) == 0
    assert not planner.plan([], [], {})


def test_only_requests_that_can_still_give_a_slice_are_active() -> None:
    """A step's plan need visit only ``active`` requests (and resumed ones): a prompt that
    shipped leaves it, an include_output request stays until it finishes, a dropped or
    finished one leaves."""
    pool, planner = BlockPool(), ShipPlanner()
    planner.add("p")
    planner.add("o", include_output=True)
    planner.add("d")
    assert planner.active == {"p", "o", "d"}
    new = [NewRequest(r, prompt_of(5), pool.take(1), 0) for r in ("p", "o", "d")]
    planner.drop("d")
    plan = planner.plan(new, [], {"p": 5, "o": 5, "d": 5})
    assert [o.request_id for o in plan.ships] == ["p"]
    assert planner.active == {"o"}  # p shipped its prompt; o ships at its finish
    # a decode step visiting only the active ones plans what visiting all of them would
    assert planner.plan([], [running("o", 5)], {"p": 1, "o": 1}).slices == [StepSlice("o", 5, 1, (), 1)]
    assert planner.finish("o", [*prompt_of(5), 9, 9], []) is True
    assert planner.finish("p", [*prompt_of(5), 9], []) is True
    assert planner.active == set()


def test_chunked_prefill_gives_one_slice_per_step_and_ships_only_in_the_last() -> None:
    pool, planner = BlockPool(1), ShipPlanner()
    prompt = prompt_of(100)
    planner.add("r")
    table = pool.take(2)  # chunk 0..29 needs two blocks
    p1 = planner.plan([NewRequest("r", prompt, table, 0)], [], {"r": 30})
    grow2 = pool.take(2)  # 30..59 needs blocks 2 and 3
    p2 = planner.plan([], [running("r", 30, grow2)], {"r": 30})
    grow3 = pool.take(3)  # 60..99 needs blocks 4..6
    p3 = planner.plan([], [running("r", 60, grow3)], {"r": 40})
    full = tuple(table + grow2 + grow3)

    # each plan carries only the blocks the workers do not have yet
    assert p1.slices == [StepSlice("r", 0, 30, tuple(table))] and p1.ships == []
    assert p2.slices == [StepSlice("r", 30, 30, tuple(grow2), 2)] and p2.ships == []
    assert p3.slices == [StepSlice("r", 60, 40, tuple(grow3), 4)]
    assert p3.ships == [ShipOrder("r", tuple(prompt), full)]
    assert not planner.plan([], [running("r", 100)], {"r": 1})


def test_a_running_request_not_scheduled_in_a_step_adds_nothing() -> None:
    planner = ShipPlanner()
    planner.add("r")
    planner.plan([NewRequest("r", prompt_of(40), [1, 2, 3], 0)], [], {"r": 16})
    assert not planner.plan([], [running("r", 16)], {})
    assert not planner.plan([], [running("r", 16)], {"r": 0})
    done = planner.plan([], [running("r", 16)], {"r": 24})
    assert done.slices == [StepSlice("r", 16, 24, (), 3)]  # the workers have the table
    assert [s.request_id for s in done.ships] == ["r"]


def test_positions_scheduled_past_the_prompt_are_not_sliced() -> None:
    planner = ShipPlanner()
    planner.add("r")
    plan = planner.plan([NewRequest("r", prompt_of(10), [4], 8)], [], {"r": 5})
    assert plan.slices == [StepSlice("r", 8, 2, (4,))]
    assert len(plan.ships) == 1


@st.composite
def chunked_schedules(draw: st.DrawFn) -> tuple[int, list[int], list[bool], int]:
    """A prompt length, its chunks in order, whether the request sits out a step before
    each later chunk, and how many decode steps follow."""
    length = draw(st.integers(1, 300))
    cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=12))) if length > 1 else []
    bounds = [0, *cuts, length]
    chunks = [hi - lo for lo, hi in itertools.pairwise(bounds)]
    idle = draw(st.lists(st.booleans(), min_size=len(chunks), max_size=len(chunks)))
    return length, chunks, idle, draw(st.integers(0, 3))


@settings(max_examples=60)
@given(chunked_schedules())
def test_any_chunking_ships_the_prompt_once_and_its_slices_tile_it(
    schedule: tuple[int, list[int], list[bool], int],
) -> None:
    length, chunks, idle, decode_steps = schedule
    pool, planner = BlockPool(length), ShipPlanner()
    prompt = prompt_of(length, seed=length)
    planner.add("r")
    table: list[int] = []
    computed, plans, expected, sent = 0, [], [], 0
    for i, n in enumerate(chunks):
        if i and idle[i]:
            plans.append(planner.plan([], [], {}))  # scheduled nothing for it this step
            expected.append([])
        grow = pool.take(nblocks(computed + n) - len(table))
        table += grow
        if i == 0:
            plans.append(planner.plan([NewRequest("r", prompt, list(table), 0)], [], {"r": n}))
        else:
            plans.append(planner.plan([], [running("r", computed, grow or None)], {"r": n}))
        expected.append([StepSlice("r", computed, n, tuple(table[sent:]), sent)])
        sent = len(table)
        computed += n
    for _ in range(decode_steps):
        grow = pool.take(nblocks(computed + 1) - len(table))
        table += grow
        plans.append(planner.plan([], [running("r", computed, grow or None)], {"r": 1}))
        expected.append([])
        computed += 1

    assert [p.slices for p in plans] == expected  # one slice per scheduled prefill step
    ships = [(i, s) for i, p in enumerate(plans) for s in p.ships]
    assert len(ships) == 1
    step, ship = ships[0]
    assert ship == ShipOrder("r", tuple(prompt), tuple(table[: nblocks(length)]))
    assert plans[step].slices[-1].start + plans[step].slices[-1].num_tokens == length
    assert all(not p for p in plans[step + 1 :])
    covered = [
        p for sl in (s for p in plans for s in p.slices) for p in range(sl.start, sl.start + sl.num_tokens)
    ]
    assert covered == list(range(length))


def test_several_requests_completing_in_one_step_all_ship_in_it() -> None:
    planner = ShipPlanner()
    prompts = {
        rid: prompt_of(n, seed=i) for i, (rid, n) in enumerate([("a", 5), ("b", 16), ("c", 40), ("d", 50)])
    }
    for rid in prompts:
        planner.add(rid)
    planner.add("e")
    first = planner.plan(
        [
            NewRequest("c", prompts["c"], [10, 11], 0),
            NewRequest("d", prompts["d"], [20, 21], 0),
            NewRequest("e", [9, 9, 9], [30], 0),
        ],
        [],
        {"c": 20, "d": 20, "e": 3},
    )
    assert [s.request_id for s in first.ships] == ["e"]

    plan = planner.plan(
        [NewRequest("a", prompts["a"], [1], 0), NewRequest("b", prompts["b"], [2], 0)],
        [running("c", 20, [12]), running("d", 20, [22]), running("e", 3)],
        {"a": 5, "b": 16, "c": 20, "d": 20, "e": 1},
    )
    assert plan.slices == [
        StepSlice("a", 0, 5, (1,)),
        StepSlice("b", 0, 16, (2,)),
        StepSlice("c", 20, 20, (12,), 2),
        StepSlice("d", 20, 20, (22,), 2),
    ]
    assert plan.ships == [
        ShipOrder("a", tuple(prompts["a"]), (1,)),
        ShipOrder("b", tuple(prompts["b"]), (2,)),
        ShipOrder("c", tuple(prompts["c"]), (10, 11, 12)),
    ]
    assert [planner.is_shipping(r) for r in "abcde"] == [True, True, True, False, True]


def test_include_output_request_ships_at_finish_with_all_tokens_but_the_last_in_the_next_plan() -> None:
    planner = ShipPlanner()
    prompt = prompt_of(20)
    planner.add("o", include_output=True)
    p1 = planner.plan([NewRequest("o", prompt, [7, 3], 0)], [], {"o": 20})
    assert p1.slices == [StepSlice("o", 0, 20, (7, 3))] and p1.ships == []
    assert not planner.is_shipping("o")
    # Decode steps are recorded too: their positions are shipped.
    p2 = planner.plan([], [running("o", 20)], {"o": 1})
    p3 = planner.plan([], [running("o", 21)], {"o": 1})
    assert p2.slices == [StepSlice("o", 20, 1, (), 2)]  # a decode step sends no table
    assert p3.slices == [StepSlice("o", 21, 1, (), 2)]
    assert p2.ships == p3.ships == []

    outputs = [101, 102, 103]  # sampled in steps 1, 2, 3; 103 never went through a forward pass
    assert planner.finish("o", prompt + outputs, [7, 3]) is True
    nxt = planner.plan([], [], {})
    assert nxt.ships == [ShipOrder("o", (*prompt, 101, 102), (7, 3))]
    assert nxt.slices == [] and nxt.resets == []
    assert not planner.plan([], [], {})  # shipped once only


def test_include_output_ship_comes_first_in_a_busy_next_step() -> None:
    planner = ShipPlanner()
    planner.add("o", include_output=True)
    planner.add("p")
    planner.plan([NewRequest("o", [1, 2, 3], [5], 0)], [], {"o": 3})
    assert planner.finish("o", [1, 2, 3, 4], [5]) is True
    plan = planner.plan([NewRequest("p", [8, 9], [6], 0)], [], {"p": 2})
    assert plan.ships == [ShipOrder("o", (1, 2, 3), (5,)), ShipOrder("p", (8, 9), (6,))]


def test_request_finished_before_its_prompt_completed_is_not_held() -> None:
    planner = ShipPlanner()
    planner.add("r")
    planner.add("never-scheduled")
    planner.plan([NewRequest("r", prompt_of(40), [1, 2, 3], 0)], [], {"r": 16})
    assert planner.finish("r", prompt_of(40), [1, 2, 3]) is False
    assert planner.finish("never-scheduled", [1, 2], []) is False
    assert planner.finish("unknown", [1, 2], [4]) is False
    assert len(planner) == 0
    assert not planner.plan([], [running("r", 16)], {"r": 24})  # no longer tracked


def test_include_output_request_finished_before_it_was_scheduled_is_not_held() -> None:
    planner = ShipPlanner()
    planner.add("o", include_output=True)
    assert planner.finish("o", [1, 2, 3], []) is False
    assert not planner.plan([], [], {})


@pytest.mark.parametrize("case", ["aborted-mid-prefill", "aborted-while-recomputing-after-preemption"])
def test_include_output_request_finished_before_its_tokens_were_computed_is_not_held(case: str) -> None:
    planner = ShipPlanner()
    prompt = prompt_of(40)
    planner.add("o", include_output=True)
    if case == "aborted-mid-prefill":
        planner.plan([NewRequest("o", prompt, [1, 2, 3], 0)], [], {"o": 16})
        all_tokens = prompt  # nothing sampled yet
    else:
        planner.plan([NewRequest("o", prompt, [1, 2, 3], 0)], [], {"o": 40})
        planner.plan([], [running("o", 40)], {"o": 1})
        # preempted, resumed into new blocks, 16 of 42 positions recomputed, then aborted
        planner.plan([], [running("o", 0, [7, 8, 9], resumed=True)], {"o": 16})
        all_tokens = [*prompt, 501, 502]
    held = planner.finish("o", all_tokens, [1, 2, 3])
    ships = planner.plan([], [], {}).ships
    assert held is False, f"held, and will ship {[len(s.token_ids) for s in ships]} positions"
    assert ships == []


def test_preemption_resets_the_block_table_and_emits_a_reset() -> None:
    planner = ShipPlanner()
    prompt = prompt_of(60)
    planner.add("r")
    p1 = planner.plan([NewRequest("r", prompt, [1, 2], 0)], [], {"r": 32})
    assert p1.slices == [StepSlice("r", 0, 32, (1, 2))] and p1.resets == []
    # preempted (absent for a step), then resumed into new blocks from scratch
    assert not planner.plan([], [], {})
    p2 = planner.plan([], [running("r", 0, [7, 8, 9, 6], resumed=True)], {"r": 60})
    assert p2.resets == ["r"]
    assert p2.slices == [StepSlice("r", 0, 60, (7, 8, 9, 6))]
    assert p2.ships == [ShipOrder("r", tuple(prompt), (7, 8, 9, 6))]


def test_preemption_resume_continues_after_prefix_cache_hits() -> None:
    planner = ShipPlanner()
    prompt = prompt_of(40)
    planner.add("r")
    planner.plan([NewRequest("r", prompt, [1, 2], 0)], [], {"r": 20})
    # Resumed with 32 positions found in the prefix cache (blocks 1 and 2 again) and a new one.
    p = planner.plan([], [running("r", 32, [1, 2, 5], resumed=True)], {"r": 8})
    assert p.resets == ["r"]
    assert p.slices == [StepSlice("r", 32, 8, (1, 2, 5))]
    assert p.ships == [ShipOrder("r", tuple(prompt), (1, 2, 5))]


def test_preemption_after_the_ship_ships_nothing_again() -> None:
    planner = ShipPlanner()
    planner.add("r")
    planner.plan([NewRequest("r", [1, 2, 3], [4], 0)], [], {"r": 3})
    p = planner.plan([], [running("r", 0, [9], resumed=True)], {"r": 4})
    assert p.slices == [] and p.ships == []
    assert planner.finish("r", [1, 2, 3, 4, 5], [9]) is True


def test_new_blocks_extend_the_table_and_untracked_running_requests_are_ignored() -> None:
    planner = ShipPlanner()
    planner.add("r")
    planner.plan([NewRequest("r", prompt_of(50), [3], 0)], [], {"r": 16})
    p = planner.plan([], [running("ghost", 0, [1]), running("r", 16, [4, 5])], {"ghost": 5, "r": 16})
    assert p.slices == [StepSlice("r", 16, 16, (4, 5), 1)]
    p = planner.plan([], [running("r", 32, [])], {"r": 18})
    assert p.slices == [StepSlice("r", 32, 18, (), 3)]
    assert p.ships[0].block_ids == (3, 4, 5)


def test_a_request_not_added_or_dropped_is_not_followed() -> None:
    planner = ShipPlanner()
    p = planner.plan([NewRequest("x", [1, 2], [8], 0)], [], {"x": 2})
    assert not p and planner.finish("x", [1, 2, 3], [8]) is False
    planner.add("y", include_output=True)
    planner.drop("y")  # e.g. its reader was unreachable past the deadline
    p = planner.plan([NewRequest("y", [1, 2], [8], 0)], [], {"y": 2})
    assert not p and planner.finish("y", [1, 2, 3], [8]) is False
    assert not planner.plan([], [], {})


def test_step_plan_is_truthy_only_with_work() -> None:
    assert not StepPlan()
    assert StepPlan(slices=[StepSlice("a", 0, 1, (1,))])
    assert StepPlan(ships=[ShipOrder("a", (1,), (1,))])
    assert StepPlan(resets=["a"])


# ============================================================== BlockRecorder


def test_record_finds_each_slice_in_a_mixed_padded_slot_mapping_and_takes_blocks_from_the_slots() -> None:
    a = StepSlice("a", 0, 20, (7, 3))  # two blocks
    b = StepSlice("b", 5, 3, (9,))  # a chunk in the middle of a block
    c = StepSlice("c", 33, 1, (4, 11, 2))  # one decode-like position in block 2
    slots = [-1, *slots_for(c.block_ids, 33, 1), *slots_for(a.block_ids, 0, 20), -1, -1]
    slots += [*slots_for(b.block_ids, 5, 3), -1]
    rec = BlockRecorder(BS)
    assert rec.record(slots, [a, b, c]) == {}
    # Recorded blocks win over whatever table is passed later: they came from the slots.
    assert rec.blocks("a", 20, (99, 98)) == ([7, 3], 0)
    assert rec.blocks("b", 8, (99,)) == ([9], 0)
    assert rec.blocks("c", 34, (4, 11, 2)) == ([4, 11, 2], 2)  # blocks 0 and 1 never written


def test_record_accumulates_chunks_over_steps() -> None:
    rec = BlockRecorder(BS)
    table = (12, 40, 5)
    assert rec.record(slots_for(table, 0, 20), [StepSlice("r", 0, 20, table[:2])]) == {}
    assert rec.record([-1, *slots_for(table, 20, 25)], [StepSlice("r", 20, 25, table)]) == {}
    assert rec.blocks("r", 45, (0, 0, 0)) == ([12, 40, 5], 0)


def test_record_with_no_slices_does_nothing() -> None:
    rec = BlockRecorder(BS)
    assert rec.record([1, 2, 3], []) == {}
    assert rec.blocks("r", 3, (0,)) == ([0], 1)


@pytest.mark.parametrize(
    "recorder_bs, neighbour, error",
    [
        (32, None, "positions 0..63 were not written where the block table puts them with block size 32"),
        # slot 32 * 5 is the neighbour's first slot: only the block table cross-check catches it
        (32, (10, 11, 12, 13), "block 1 was written to cache block 6, the block table says 2"),
        (8, None, "positions 0..63 were not written where the block table puts them with block size 8"),
        (8, (30, 31, 32, 33), "block 1 was written to cache block 18, the block table says 2"),
    ],
    ids=["32-alone", "32-with-neighbour", "8-alone", "8-with-neighbour"],
)
def test_record_reports_slots_written_with_another_block_size(
    recorder_bs: int, neighbour: tuple[int, ...] | None, error: str
) -> None:
    table = (5, 2, 9, 7)  # scattered blocks, in units of the writer's block size 16
    slots = slots_for(table, 0, 64, bs=16)
    slices = [StepSlice("r", 0, 64, table)]
    if neighbour:  # another request's rows after it, so that a wrong row + num_tokens still fits
        slots += slots_for(neighbour, 0, 64, bs=16)
    assert BlockRecorder(recorder_bs).record(slots, slices) == {"r": error}


@settings(max_examples=60)
@given(
    table=st.lists(st.integers(0, 60), min_size=16, max_size=16, unique=True),
    writer_bs=st.sampled_from([4, 8, 16, 32]),
    recorder_bs=st.sampled_from([4, 8, 16, 32]),
    start=st.integers(0, 63),
    n=st.integers(1, 64),
    pad_before=st.integers(0, 3),
    pad_after=st.integers(0, 3),
)
def test_record_accepts_a_slice_only_when_its_slots_are_where_the_recorder_would_put_them(
    table: list[int], writer_bs: int, recorder_bs: int, start: int, n: int, pad_before: int, pad_after: int
) -> None:
    n = min(n, 64 - start)
    written = slots_for(table, start, n, bs=writer_bs)
    expected = slots_for(table, start, n, bs=recorder_bs)
    rec = BlockRecorder(recorder_bs)
    padded = [-1] * pad_before + written + [-1] * pad_after
    errors = rec.record(padded, [StepSlice("r", start, n, tuple(table))])
    if written == expected:  # always so when the block sizes agree
        assert errors == {}
        first, last = start // recorder_bs, (start + n - 1) // recorder_bs
        sentinel = [-1 - j for j in range(16)]  # what blocks() returns for a block never recorded
        got, from_table = rec.blocks("r", start + n, sentinel)
        assert got == sentinel[:first] + table[first : last + 1] and from_table == first
    else:
        assert set(errors) == {"r"}
    assert recorder_bs != writer_bs or errors == {}


def test_record_reports_a_first_block_that_disagrees_with_the_block_table() -> None:
    ok = StepSlice("ok", 0, 4, (1,))
    bad = StepSlice("bad", 0, 20, (7, 3))
    slots = slots_for((1,), 0, 4) + slots_for((8, 3), 0, 20)  # written to block 8, table says 7
    rec = BlockRecorder(BS)
    errors = rec.record(slots, [bad, ok])
    assert set(errors) == {"bad"} and "not written where the block table puts them" in errors["bad"]
    assert rec.blocks("ok", 4, (0,)) == ([1], 0)  # the other request is still recorded


def test_record_reports_a_later_block_that_disagrees_with_the_block_table() -> None:
    bad = StepSlice("bad", 0, 40, (7, 3, 4))
    slots = slots_for((7, 6, 4), 0, 40)  # block 1 written to cache block 6
    errors = BlockRecorder(BS).record(slots, [bad])
    assert errors == {"bad": "block 1 was written to cache block 6, the block table says 3"}


def test_record_reports_positions_that_straddle_two_cache_blocks_within_one_block() -> None:
    sl = StepSlice("r", 0, 16, (7,))
    slots = slots_for((7,), 0, 8) + [8 * BS + o for o in range(8, 16)]
    errors = BlockRecorder(BS).record(slots, [sl])
    assert errors == {"r": "positions of block 0 map to cache blocks 7 and 8"}


def test_record_reports_a_slice_that_runs_into_padding_or_off_the_end() -> None:
    sl = StepSlice("r", 0, 10, (3,))
    into_padding = slots_for((3,), 0, 6) + [-1] * 4
    assert "no cache slot" in BlockRecorder(BS).record(into_padding, [sl])["r"]
    off_the_end = slots_for((3,), 0, 6)
    assert "not written where" in BlockRecorder(BS).record(off_the_end, [sl])["r"]


def test_record_reports_a_slice_beyond_the_block_table() -> None:
    errors = BlockRecorder(BS).record(list(range(64)), [StepSlice("r", 32, 1, (0, 1))])
    assert errors == {"r": "position 32 has no block in the block table"}


def test_blocks_fall_back_to_the_table_for_prefix_cache_hits_and_count_them() -> None:
    planner, rec = ShipPlanner(), BlockRecorder(BS)
    prompt, table = prompt_of(40), [3, 8, 6]
    planner.add("r")
    plan = planner.plan([NewRequest("r", prompt, table, 32)], [], {"r": 8})  # 2 blocks hit
    assert plan.slices == [StepSlice("r", 32, 8, (3, 8, 6))]
    assert rec.record(slots_for(table, 32, 8), plan.slices) == {}
    (ship,) = plan.ships
    assert rec.blocks("r", len(ship.token_ids), ship.block_ids) == ([3, 8, 6], 2)


def test_blocks_of_an_exact_number_of_blocks_and_of_nothing() -> None:
    rec = BlockRecorder(BS)
    assert rec.blocks("r", 32, (1, 2, 3)) == ([1, 2], 2)
    assert rec.blocks("r", 0, ()) == ([], 0)


def test_blocks_raise_slot_mismatch_when_the_table_is_too_short() -> None:
    with pytest.raises(SlotMismatch, match="33 tokens need 3 blocks, the block table has 2"):
        BlockRecorder(BS).blocks("r", 33, (1, 2))


def test_forget_drops_what_was_recorded() -> None:
    rec = BlockRecorder(BS)
    assert rec.record(slots_for((5,), 0, 3), [StepSlice("r", 0, 3, (5,))]) == {}
    rec.forget("r")
    rec.forget("never-seen")
    assert rec.blocks("r", 3, (6,)) == ([6], 1)


@pytest.mark.parametrize("bs", [0, -16])
def test_recorder_rejects_a_non_positive_block_size(bs: int) -> None:
    with pytest.raises(ValueError, match="block size must be positive"):
        BlockRecorder(bs)


def test_preemption_reset_then_recompute_ships_the_new_blocks() -> None:
    planner, rec = ShipPlanner(), BlockRecorder(BS)
    prompt = prompt_of(40)
    planner.add("r")
    p1 = planner.plan([NewRequest("r", prompt, [1, 2], 0)], [], {"r": 32})
    assert rec.record(slots_for((1, 2), 0, 32), p1.slices) == {}
    p2 = planner.plan([], [running("r", 0, [7, 8, 9], resumed=True)], {"r": 40})
    for rid in p2.resets:
        rec.forget(rid)
    assert rec.record(slots_for((7, 8, 9), 0, 40), p2.slices) == {}
    (ship,) = p2.ships
    assert rec.blocks("r", 40, ship.block_ids) == ([7, 8, 9], 0)


# ============================================== both sides together, many requests


@settings(max_examples=30)
@given(
    lengths=st.lists(st.integers(1, 120), min_size=1, max_size=6),
    budget=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_planner_and_recorder_ship_every_prompt_once_from_the_blocks_it_was_written_to(
    lengths: list[int], budget: int, seed: int
) -> None:
    """A toy scheduler (token budget, chunked prefill, prefix-cache hits, a few decode steps
    per request) drives the planner; a toy worker writes each step's slices to a shuffled,
    padded slot mapping and records them."""
    rng, pool = random.Random(seed), BlockPool(seed)
    planner, rec = ShipPlanner(), BlockRecorder(BS)
    prompts = {f"r{i}": prompt_of(n, seed=i) for i, n in enumerate(lengths)}
    hits = {rid: rng.randrange(0, nblocks(len(p))) for rid, p in prompts.items()}  # cached blocks
    decodes = {rid: rng.randrange(0, 3) for rid in prompts}
    tables: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    ships: dict[str, tuple[ShipOrder, tuple[list[int], int]]] = {}
    for rid in prompts:
        planner.add(rid)
    for _step in range(400):
        if not prompts.keys() - ships.keys() and not decodes.keys() & computed.keys():
            break
        left, new, run, sched = budget, [], [], {}
        for rid, prompt in prompts.items():
            if left == 0:
                break
            first = rid not in computed
            if first:
                if rid in ships:
                    continue  # finished
                computed[rid] = hits[rid] * BS
                tables[rid] = []
            if computed[rid] < len(prompt):
                n = min(len(prompt) - computed[rid], left)
            elif decodes[rid] > 0:
                decodes[rid] -= 1
                n = 1
            else:
                assert planner.finish(rid, [*prompt, 1], tables[rid]) is True
                del computed[rid]
                continue
            left -= n
            grow = pool.take(nblocks(computed[rid] + n) - len(tables[rid]))
            tables[rid] += grow
            sched[rid] = n
            if first:
                new.append(NewRequest(rid, prompt, list(tables[rid]), computed[rid]))
            else:
                run.append(running(rid, computed[rid], grow or None))
        plan = planner.plan(new, run, sched)
        rows = [slots_for(tables[s.request_id], s.start, s.num_tokens) for s in plan.slices]
        rng.shuffle(rows)
        slots = [-1] * rng.randrange(3)
        for r in rows:
            slots += r + [-1] * rng.randrange(2)
        assert rec.record(slots, plan.slices) == {}
        for s in plan.ships:
            assert s.request_id not in ships, "shipped twice"
            ships[s.request_id] = (s, rec.blocks(s.request_id, len(s.token_ids), s.block_ids))
            rec.forget(s.request_id)
        for rid, n in sched.items():
            computed[rid] += n
    assert set(ships) == set(prompts)
    assert len(planner) == 0
    for rid, (order, (blocks, from_table)) in ships.items():
        assert order.token_ids == tuple(prompts[rid])
        assert blocks == tables[rid][: nblocks(len(prompts[rid]))]
        assert from_table == hits[rid]


def test_preempted_tracked_requests_are_passed_to_the_workers() -> None:
    planner = ShipPlanner()
    planner.add("p")
    planner.plan([NewRequest("p", prompt_of(10), [1], 0)], [], {"p": 10})
    plan = planner.plan([], [], {}, preempted={"p", "untracked"})
    assert plan.preempted == ["p"] and bool(plan)


def test_router_hash_is_stable_and_spreads_and_round_robin_cycles() -> None:
    a, b, c = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
    h = Router([a, b, c])
    ids = [f"req-{i}" for i in range(300)]
    first = [h.route(r) for r in ids]
    assert first == [h.route(r) for r in ids]  # the same on every rank and every call
    assert min(first.count(k) for k in (a, b, c)) > 60
    rr = Router([a, b, c], "round_robin")
    assert [rr.route(r) for r in ids[:7]] == [a, b, c, a, b, c, a]
    assert Router([a]).route("x") == a


def test_ship_orders_carry_the_reader_bound_at_admission_and_finish_reports_it() -> None:
    readers = ["10.0.0.1:1", "10.0.0.2:1"]
    table = RequestTable()
    book = DeliveryBook(5.0, table=table)
    options = ConnectorOptions.parse({"consumer_address": readers, "sharding": "round_robin"})
    mode = PushScheduling(options, book, "p", 1)
    planner = ShipPlanner(table, route=mode.route)
    mode.update(WorkerReport(links=[LinkChange(r, 0, None) for r in readers]))
    for rid in ("a", "b", "c"):
        planner.add(rid)
        book.add(rid)
        assert mode.admit(rid).reader is not None
    plan = planner.plan(
        [NewRequest(r, prompt_of(5), [1], 0) for r in ("a", "b", "c")], [], {"a": 5, "b": 5, "c": 5}
    )
    assert [(o.request_id, o.route) for o in plan.ships] == [
        ("a", readers[0]),
        ("b", readers[1]),
        ("c", readers[0]),
    ]


def test_a_decode_step_plan_does_not_grow_with_the_block_table() -> None:
    """256 requests with long tables, decoding with output tokens: after the first plan,
    a step's plan carries one slice per request and only the blocks added since."""
    planner, bs = ShipPlanner(), BS
    tables = {f"r{i}": list(range(i * 300, i * 300 + 256)) for i in range(256)}
    for rid in tables:
        planner.add(rid, include_output=True)
    planner.plan(
        [NewRequest(rid, prompt_of(256 * bs), t, 0) for rid, t in tables.items()],
        [],
        dict.fromkeys(tables, 256 * bs),
    )
    step = planner.plan([], [running(rid, 256 * bs) for rid in tables], dict.fromkeys(tables, 1))
    assert len(step.slices) == 256 and all(sl.block_ids == () for sl in step.slices)
    grow = planner.plan([], [running("r0", 256 * bs + 1, [9999])], {"r0": 1})
    assert grow.slices == [StepSlice("r0", 256 * bs + 1, 1, (9999,), 256)]


@settings(max_examples=150)
@given(
    data=st.data(),
    num=st.integers(1, 12),
    recorder_bs=st.sampled_from([4, 16]),
)
def test_check_step_fails_exactly_the_slices_check_slots_fails_with_the_same_messages(
    data: st.DataObject, num: int, recorder_bs: int
) -> None:
    """The step check's shortcut for one-position slices (a set of the slots written) is
    ``check_slots`` itself: same requests failed, same words, whatever is wrong."""
    bs = recorder_bs
    rec = BlockRecorder(bs)
    slices, slots = [], []
    for i in range(num):
        table = data.draw(st.lists(st.integers(0, 40), min_size=4, max_size=4, unique=True))
        start = data.draw(st.integers(0, 4 * bs - 1))
        n = data.draw(st.sampled_from([1, 1, 1, min(3, 4 * bs - start), 4 * bs - start]))
        slices.append(StepSlice(f"r{i}", start, n, tuple(table)))
        rows = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        how = data.draw(st.sampled_from(["ok", "ok", "pad", "shift", "other", "drop", "last"]))
        k = data.draw(st.integers(0, n - 1))
        if how == "pad":
            rows[k] = -1
        elif how == "shift":
            rows[k] += 1
        elif how == "other":
            rows[k] = data.draw(st.integers(0, 41 * bs))
        elif how == "drop":
            rows = rows[:k]
        elif how == "last":
            rows = [*rows[:k], (table[(start + k) // bs] + 1) * bs + (start + k) % bs, *rows[k + 1 :]]
        slots.append(rows)
    order = data.draw(st.permutations(range(num)))  # the runner's rows need not follow the plan
    flat = [-1, *(x for i in order for x in slots[i]), -1]
    planned, errors = rec.slots_of(slices)
    assert errors == {}
    assert len(planned) == num
    assert check_step(flat, planned, bs) == check_slots(flat, planned.all_spans(), bs)


def test_expect_keeps_a_one_position_slice_s_block_when_its_table_changes_before_the_check() -> None:
    """On a GPU a step is checked after later steps changed the tables: each step is
    checked against the table it ran with."""
    rec = BlockRecorder(BS)
    first, _ = rec.slots_of([StepSlice("r", 17, 1, (3, 5))])
    later, _ = rec.slots_of([StepSlice("r", 0, 1, (9,), blocks_from=0)])  # reset: a new table
    assert check_step([5 * BS + 1], first, BS) == {}
    assert check_step([9 * BS + 1], first, BS) == {
        "r": f"positions 17..17 were not written where the block table puts them with block size {BS}"
    }
    assert check_step([9 * BS], later, BS) == {}


def test_a_plan_travels_to_the_workers_with_its_slices_as_plain_tuples() -> None:
    """Pickled as vLLM ships it: equal after the trip, each slice a ``StepSlice`` again,
    and none pickled as an instance (a decode step with output tokens carries hundreds)."""
    import pickle

    from kv_connector.producer.planning import StepPlan

    slices = [StepSlice(f"r{i}", 100 + i, 1, (i, i + 1), 3) for i in range(256)]
    ships = [ShipOrder("s", (1, 2), (9,), route="n")]
    plan = StepPlan(slices=slices, ships=ships, resets=["x"], news=("end", 1))
    data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    back = pickle.loads(data)
    assert back == plan and all(type(sl) is StepSlice for sl in back.slices)
    assert back.slices[7].start == 107 and back.slices[7].block_ids == (7, 8)
    assert b"StepSlice" not in data
