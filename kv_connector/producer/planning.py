"""What to ship and when: the scheduler-side plan and the worker-side block record. Pure logic.

The scheduler side (``ShipPlanner``) turns each engine step into a ``StepPlan``: which
positions of which tracked request this step computes, and which requests are complete and
ship now. The worker side (``BlockRecorder``) finds those positions in the slot mapping the
cache-only layer wrote with, and records the cache block of every position from its slot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from kv_connector.common.errors import ConfigurationError, IntegrityError
from kv_connector.producer.request_table import RequestRecord, RequestTable
from kv_connector.wire.identity import NO_IDENTITY, SampleIdentity
from kv_connector.wire.layout import blocks_for, blocks_for_tokens, kernel_block_ids


class StepSlice(NamedTuple):
    """Positions ``start .. start + num_tokens - 1`` of a request, computed in this step.

    ``block_ids`` is the request's block table from index ``blocks_from`` on: only the blocks the
    workers do not have yet, so a step's plan stays as small as what changed. The worker uses
    the table only to find this slice's rows in the step's slot mapping and to cross-check them.
    A tuple, so a step's hundreds of slices travel to the workers as plain tuples (``StepPlan``).
    """

    request_id: str
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    blocks_from: int = 0


@dataclass(frozen=True)
class ShipOrder:
    """Ship the states of ``token_ids`` (positions 0..len-1) of a request now, under the
    ``identity`` its request gave (checked on the scheduler side).

    ``route`` is what its delivery mode addresses the sample by, the same on every rank
    (``SchedulerMode.route``): in push the reader's address, in pull its handle's nonce."""

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    identity: SampleIdentity = NO_IDENTITY
    route: str | None = None


@dataclass
class StepPlan:
    slices: list[StepSlice] = field(default_factory=list)
    ships: list[ShipOrder] = field(default_factory=list)
    resets: list[str] = field(default_factory=list)
    # tracked requests preempted by this step: their blocks are about to be reused, so
    # WRITEs still reading them must finish first (see WorkerSide.handle_preemptions)
    preempted: list[str] = field(default_factory=list)
    # what the delivery mode's scheduler part tells its workers this step, in a record of
    # the mode's own, carried unread (pull: the holds to end); None: nothing
    news: object | None = None

    def __bool__(self) -> bool:
        return bool(self.slices or self.ships or self.resets or self.preempted or self.news is not None)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled for the workers with its slices as plain tuples: with output tokens a
        decode step carries a slice of every request, and a tuple pickles and loads in a
        fraction of a class instance's time."""
        rows = list(map(tuple, self.slices))
        return _plan_from, (rows, self.ships, self.resets, self.preempted, self.news)


def _plan_from(
    rows: list[tuple[Any, ...]],
    ships: list[ShipOrder],
    resets: list[str],
    preempted: list[str],
    news: object | None,
) -> StepPlan:
    """A pickled ``StepPlan`` again (``StepPlan.__reduce__``)."""
    make = tuple.__new__
    return StepPlan([make(StepSlice, row) for row in rows], ships, resets, preempted, news)


def in_kernel_blocks(plan: StepPlan, kernel_blocks: int) -> StepPlan:
    """The plan with every block table in the cache tensor's kernel blocks (``layout.kernel_block_ids``).

    The scheduler plans in the KV cache manager's blocks, while the worker reads a tensor vLLM
    split into ``kernel_blocks`` kernel blocks each.
    """
    if kernel_blocks == 1:
        return plan
    return replace(
        plan,
        slices=[
            sl._replace(
                block_ids=tuple(kernel_block_ids(sl.block_ids, kernel_blocks)),
                blocks_from=sl.blocks_from * kernel_blocks,
            )
            for sl in plan.slices
        ],
        ships=[replace(o, block_ids=tuple(kernel_block_ids(o.block_ids, kernel_blocks))) for o in plan.ships],
    )


class NewRequest(NamedTuple):
    """A request vLLM schedules for the first time (or again, after a preemption freed it)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    block_ids: Sequence[int]
    num_computed_tokens: int


Running = tuple[str, Sequence[int] | None, bool, int]
"""A request vLLM scheduled before: (request id, the blocks it gained, whether it resumes
from a preemption, its computed tokens). A plain tuple: a decode step makes one for each
request it follows."""
# a StepSlice from its fields, without NamedTuple's keyword handling
_make_slice = tuple.__new__


class ShipPlanner:
    """Scheduler side: follows each request until its prompt is computed.

    By default a request ships in the step that computes its last prompt token. One added with
    ``include_output=True`` ships when it finishes, with all output tokens but the last; the last
    sampled token never went through a forward pass, so it has no hidden state. The planner's
    state of a request is its ``RequestRecord``, shared with the delivery book through ``table``.
    """

    def __init__(
        self, table: RequestTable | None = None, route: Callable[[str], str | None] | None = None
    ) -> None:
        self.table = table if table is not None else RequestTable()
        # a request's route, as its delivery mode names it (``ShipOrder.route``)
        self.route: Callable[[str], str | None] = route if route is not None else lambda rid: None
        self._pending_ships: list[ShipOrder] = []
        # the requests a step can still give a slice: followed and not shipped (with
        # include_output, until they finish); a step's plan need visit no other
        self.active: set[str] = set()

    def _tracked(self, request_id: str) -> RequestRecord | None:
        rec = self.table.get(request_id)
        return rec if rec is not None and rec.tracked else None

    def _order(self, rec: RequestRecord, tokens: tuple[int, ...], blocks: tuple[int, ...]) -> ShipOrder:
        return ShipOrder(rec.request_id, tokens, blocks, rec.identity, self.route(rec.request_id))

    def drop(self, request_id: str) -> None:
        """Stop following a request: it runs, but nothing of it is shipped."""
        rec = self.table.get(request_id)
        if rec is not None:
            # its reader stays: its kv_transfer_params name it
            rec.tracked = False
        self.active.discard(request_id)
        self._pending_ships = [o for o in self._pending_ships if o.request_id != request_id]

    def __len__(self) -> int:
        return sum(1 for rec in self.table if rec.tracked)

    def add(
        self, request_id: str, include_output: bool = False, identity: SampleIdentity = NO_IDENTITY
    ) -> None:
        """Follow a new request (its planning state starts afresh)."""
        rec = self.table.ensure(request_id)
        rec.include_output, rec.tracked, rec.identity = include_output, True, identity
        rec.prompt, rec.block_ids, rec.computed, rec.shipped, rec.sent_blocks = (), [], 0, False, 0
        self.active.add(request_id)

    def is_tracked(self, request_id: str) -> bool:
        return self._tracked(request_id) is not None

    def is_shipping(self, request_id: str) -> bool:
        t = self._tracked(request_id)
        return t is not None and t.shipped

    def plan(
        self,
        new: Sequence[NewRequest],
        running: Sequence[Running],
        num_scheduled: dict[str, int],
        preempted: Iterable[str] = (),
    ) -> StepPlan:
        """This step's slices, ships and resets. ``running`` need hold only the requests in
        ``active`` and the resumed ones: no other can give a slice."""
        plan = StepPlan(ships=self._pending_ships)
        self._pending_ships = []
        plan.preempted = [rid for rid in preempted if self._tracked(rid) is not None]
        record_of, step = self.table.get, self._step
        for n in new:
            t = record_of(n.request_id)
            # not added, or dropped (it runs without shipping)
            if t is None or not t.tracked:
                continue
            t.prompt = tuple(n.prompt_token_ids)
            t.block_ids = list(n.block_ids)
            t.sent_blocks = 0
            # a prefix-cache hit is computed already
            t.computed = n.num_computed_tokens
            step(plan, t, n.num_computed_tokens, num_scheduled.get(n.request_id, 0))
        for rid, new_block_ids, resumed, computed in running:
            t = record_of(rid)
            if t is None or not t.tracked:
                continue
            if resumed:
                # Preempted and rescheduled: the old blocks are gone, recompute from here.
                t.block_ids = list(new_block_ids or [])
                # the workers forget its table (reset)
                t.sent_blocks = 0
                t.computed = computed
                plan.resets.append(rid)
            elif new_block_ids:
                t.block_ids.extend(new_block_ids)
            step(plan, t, computed, num_scheduled.get(rid, 0))
        return plan

    def _step(self, plan: StepPlan, record: RequestRecord, start: int, num_tokens: int) -> None:
        if num_tokens <= 0 or record.shipped:
            return
        if start + num_tokens > record.computed:
            record.computed = start + num_tokens
        if not record.include_output:
            num_tokens = min(num_tokens, len(record.prompt) - start)
            if num_tokens <= 0:
                return
        sent, table = record.sent_blocks, record.block_ids
        # only the blocks the workers do not have yet: in a decode step, usually none
        blocks = tuple(table[sent:]) if sent < len(table) else ()
        plan.slices.append(_make_slice(StepSlice, (record.request_id, start, num_tokens, blocks, sent)))
        record.sent_blocks = len(table)
        if not record.include_output and start + num_tokens >= len(record.prompt):
            record.shipped = True
            self.active.discard(record.request_id)
            plan.ships.append(self._order(record, record.prompt, tuple(record.block_ids)))

    def finish(self, request_id: str, all_token_ids: Sequence[int], block_ids: Sequence[int]) -> bool:
        """The request finished; True if the connector holds its blocks because a ship was or will be made.

        False if it never got far enough to ship: it was aborted before its prompt (or, with
        ``include_output``, its tokens) were all computed. The record stays until the caller removes
        it from the table.
        """
        self.active.discard(request_id)
        t = self._tracked(request_id)
        if t is None:
            return False
        t.tracked = False
        if t.include_output and not t.shipped:
            tokens = tuple(all_token_ids[:-1]) if len(all_token_ids) > 1 else tuple(all_token_ids)
            if not t.prompt or not tokens or t.computed < len(tokens):
                return False
            t.shipped = True
            self._pending_ships.append(self._order(t, tokens, tuple(block_ids)))
            return True
        return t.shipped


class SlotMismatch(IntegrityError):
    """The slot mapping the layer wrote with disagrees with the request's block table."""


@dataclass(frozen=True)
class SlotSpan:
    """Where a slice's positions ``start .. start + num_tokens - 1`` must have been written:
    block ``first_block + k`` of the request is cache block ``blocks[k]``."""

    request_id: str
    start: int
    num_tokens: int
    first_block: int
    blocks: tuple[int, ...]


def check_slots(slots: Sequence[int], planned: Sequence[SlotSpan], block_size: int) -> dict[str, str]:
    """Check each slice against the slot mapping the cache-only layer wrote with; {request_id: error}.

    A slice's rows are found by the slot of its first position. Every slot of them must sit at
    its position's offset in the block its table names.
    """
    if not planned:
        return {}
    bs = block_size
    row_of: dict[int, int] = {s: i for i, s in enumerate(slots) if s >= 0}
    errors: dict[str, str] = {}
    for e in planned:
        row = row_of.get(e.blocks[0] * bs + e.start % bs)
        if row is None or row + e.num_tokens > len(slots):
            errors[e.request_id] = (
                f"positions {e.start}..{e.start + e.num_tokens - 1} were not written where "
                f"the block table puts them with block size {bs}"
            )
            continue
        try:
            pairs = blocks_for_tokens(slots[row : row + e.num_tokens], bs, e.start)
        except ValueError as err:
            errors[e.request_id] = str(err)
            continue
        for j, b in pairs:
            k = j - e.first_block
            want = e.blocks[k] if 0 <= k < len(e.blocks) else None
            if want != b:
                errors[e.request_id] = (
                    f"block {j} was written to cache block {b}, the block table says {want}"
                )
                break
    return errors


@dataclass
class StepSlots:
    """Where a step's slices must have been written, for ``check_step``.

    A one-position slice (a decode step) is kept as its planned slot alone, the common case
    that must stay cheap. It passes ``check_slots`` exactly when that slot is non-negative and in
    the slot mapping. Longer slices are kept as ``SlotSpan``.
    """

    # one-position slices: (request_id, position, block index, cache block), and their slots
    singles: list[tuple[str, int, int, int]] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)
    spans: list[SlotSpan] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.firsts or self.spans)

    def __len__(self) -> int:
        return len(self.firsts) + len(self.spans)

    def all_spans(self) -> list[SlotSpan]:
        """Every slice as a ``SlotSpan`` (the one-position ones first)."""
        return [SlotSpan(rid, p, 1, j, (b,)) for rid, p, j, b in self.singles] + self.spans


# a slot mapping's stable argsort, and its slots in that order
SortedSlots = tuple[np.ndarray, np.ndarray]


def sort_slots(slots: np.ndarray) -> SortedSlots:
    """The step's slots sorted once, for ``check_step`` and ``first_rows`` to share."""
    order = np.argsort(slots, kind="stable")
    return order, slots[order]


def check_step(
    slots: Sequence[int] | np.ndarray, planned: StepSlots, block_size: int, ranked: SortedSlots | None = None
) -> dict[str, str]:
    """``check_slots`` for a step's ``StepSlots``: the same failures, with the same messages.

    One-position slices are checked at once against the set of slots written. Longer ones compare
    their rows with the slots their table gives (``_spans_off``). Only those that fail go through
    ``check_slots``, for its message. ``slots`` is the step's slot mapping on the host;
    ``ranked`` its ``sort_slots``, when the caller has it.
    """
    arr = np.asarray(slots, dtype=np.int64)
    # the slots as Python ints, made when a Python path needs them
    listed: list[int] = []
    errors: dict[str, str] = {}
    if planned.spans:
        off = _spans_off(arr, planned.spans, block_size, ranked or sort_slots(arr))
        if off:
            listed = arr.tolist()
            errors.update(check_slots(listed, off, block_size))
    firsts = planned.firsts
    if firsts:
        listed = listed or arr.tolist()
        written = set(listed)
        if min(firsts) < 0 or not written.issuperset(firsts):
            bad = [
                SlotSpan(rid, p, 1, j, (b,))
                for (rid, p, j, b), x in zip(planned.singles, firsts, strict=True)
                if x < 0 or x not in written
            ]
            errors.update(check_slots(listed, bad, block_size))
    return errors


def _spans_off(
    slots: np.ndarray, spans: Sequence[SlotSpan], bs: int, sorted_slots: SortedSlots
) -> list[SlotSpan]:
    """The slices ``check_slots`` may fail, found with a few array operations a slice.

    A slice passes there exactly when the rows from the last row holding its first slot hold, one
    for one, the slots its table gives. With no slot written twice that row is the only one, so a
    slice whose rows equal those slots passes. Every other slice is returned, and all of them when
    a slot was written twice. This avoids a Python loop over a prefill chunk's thousands of tokens.
    """
    order, ranked = sorted_slots
    if bool(np.any((ranked[1:] == ranked[:-1]) & (ranked[1:] >= 0))):
        return list(spans)
    off: list[SlotSpan] = []
    for e in spans:
        first = e.blocks[0] * bs + e.start % bs
        k = int(np.searchsorted(ranked, first))
        if k >= len(ranked) or ranked[k] != first:
            off.append(e)
            continue
        row, n = int(order[k]), e.num_tokens
        pos = np.arange(e.start, e.start + n, dtype=np.int64)
        j = pos // bs - e.first_block
        if n < 1 or row + n > len(slots) or j[0] < 0 or j[-1] >= len(e.blocks):
            off.append(e)
            continue
        want = np.asarray(e.blocks, dtype=np.int64)[j] * bs + pos % bs
        if not np.array_equal(slots[row : row + n], want):
            off.append(e)
    return off


class BlockRecorder:
    """Worker side: the cache block of each position of each request, from the step's slot mapping.

    Blocks are in units of the cache tensor's own block size, which may be a kernel block.
    """

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ConfigurationError(f"block size must be positive, got {block_size}")
        self.block_size = block_size
        self._blocks: dict[str, dict[int, int]] = {}
        # what the plans sent of each block table
        self._tables: dict[str, list[int]] = {}

    def forget(self, request_id: str) -> None:
        self._blocks.pop(request_id, None)
        self._tables.pop(request_id, None)

    def slots_of(self, slices: Sequence[StepSlice]) -> tuple[StepSlots, dict[str, str]]:
        """Apply each slice's part of its block table and say where its positions must have been written.

        It returns those, for ``check_step`` once the slot mapping is on the host, and {request_id:
        error} for slices whose table is already wrong. It runs on the engine's thread every step for
        every running request, so it costs a few operations a slice.
        """
        bs = self.block_size
        out = StepSlots()
        singles, firsts, spans = out.singles, out.firsts, out.spans
        tables = self._tables
        errors: dict[str, str] = {}
        # a StepSlice's fields, unpacked at once
        for rid, start, n, block_ids, frm in slices:
            table = tables.get(rid)
            if table is None:
                table = tables[rid] = []
            # the plan sends a change of its table
            if frm != len(table) or block_ids:
                if frm > len(table):
                    errors[rid] = f"{rid}: block table from {frm}, the worker has {len(table)}"
                    continue
                del table[frm:]
                table.extend(block_ids)
            j0 = start // bs
            if j0 >= len(table):
                errors[rid] = f"position {start} has no block in the block table"
                continue
            if n == 1:
                b = table[j0]
                singles.append((rid, start, j0, b))
                firsts.append(b * bs + start % bs)
            else:
                j1 = (start + n - 1) // bs
                spans.append(SlotSpan(rid, start, n, j0, tuple(table[j0 : j1 + 1])))
        return out, errors

    def record(self, slots: Sequence[int], slices: Sequence[StepSlice]) -> dict[str, str]:
        """Find each slice's rows in ``slots`` (the step's slot mapping) and record the
        blocks they wrote; returns {request_id: error} for slices that do not match."""
        if not slices:
            return {}
        planned, errors = self.slots_of(slices)
        found = check_step(slots, planned, self.block_size)
        errors.update(found)
        for e in planned.all_spans():
            if e.request_id not in found:
                rec = self._blocks.setdefault(e.request_id, {})
                rec.update((e.first_block + k, b) for k, b in enumerate(e.blocks))
        return errors

    def ship_blocks(self, num_tokens: int, table: Sequence[int]) -> list[int]:
        """The cache blocks of positions 0..num_tokens-1 in order: the request's block table.

        Every slice's slots are checked against it (``check_slots``) before a byte of them is read.
        """
        nb = blocks_for(num_tokens, self.block_size)
        if nb > len(table):
            raise SlotMismatch(f"{num_tokens} tokens need {nb} blocks, the block table has {len(table)}")
        return [int(b) for b in table[:nb]]

    def blocks(self, request_id: str, num_tokens: int, table: Sequence[int]) -> tuple[list[int], int]:
        """The cache blocks of positions 0..num_tokens-1, and how many came from the block table.

        Those were not recorded writes: prefix-cache hits, computed by an earlier request.
        """
        rec = self._blocks.get(request_id, {})
        nb = blocks_for(num_tokens, self.block_size)
        if nb > len(table):
            raise SlotMismatch(f"{num_tokens} tokens need {nb} blocks, the block table has {len(table)}")
        out, from_table = [], 0
        for j in range(nb):
            b = rec.get(j)
            if b is None:
                b = table[j]
                from_table += 1
            out.append(b)
        return out, from_table



def first_rows(slots: np.ndarray, firsts: np.ndarray, ranked_slots: SortedSlots | None = None) -> np.ndarray:
    """The row of each slot of ``firsts`` in the step's slot mapping, or -1 where no row holds it.

    It is the last row holding the slot, as ``check_slots`` finds a slice's first position.
    """
    order, ranked = ranked_slots or sort_slots(slots)
    k = np.searchsorted(ranked, firsts, side="right") - 1
    at = np.clip(k, 0, None)
    found = (k >= 0) & (ranked[at] == firsts) if len(ranked) else np.zeros(len(firsts), dtype=bool)
    return np.where(found, order[at] if len(ranked) else 0, -1)
