"""The step's barrier and its slot-mapping check, off the step's critical path.

The engine never waits for the device here. At the end of a step, after the drafter wrote
the hidden states, the worker side hands ``SlotChecks.add`` the slot mapping the cache-only
layer wrote with. On a GPU the mapping is copied to pinned host memory without blocking,
and an event is recorded after the copy on the engine's stream, so after the drafter. On
CPU a stand-in that is always done takes the event's place, and the same code runs.

A step is checked (``planning.check_step``) once its event is done, in step order, by
whoever asks first. That is the worker side at its next hook, or a sender thread asking a
``StepGate`` whether a request's blocks may be read. Until then nothing reads them: the
sender holds the request's job (no credit request, no checksum, no WRITE).

The same step's input ids travel beside its slot mapping: the tokens the forward pass
computed each row from. Each slice's rows are kept. A shipped sample's token ids are
compared with them once its last step is checked (``compare_tokens``). A position computed
from another token than the sample names fails the sample by name; checksums cannot see
it. vLLM #56417 is such a case: a drafter fed back another token than the one committed.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from kv_connector.common.device import DeviceEvent, HostDone
from kv_connector.producer.planning import SortedSlots, StepSlots, check_step, first_rows, sort_slots

# positions a token mismatch names
MAX_NAMED = 3


@dataclass
class _Step:
    seq: int
    done: DeviceEvent
    # on the host once ``done``
    slots: torch.Tensor | None
    planned: StepSlots
    # the step's input ids, row for row with ``slots``
    inputs: torch.Tensor | None = None


class SlotChecks:
    """Every step's slot mapping on its way to the host, checked in step order once it
    arrives. ``failed`` keeps each request's first failure until ``forget``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pending: deque[_Step] = deque()
        self._next = 0
        # the last step checked
        self._settled = -1
        # failures found since ``settle`` last returned them
        self._news: dict[str, str] = {}
        # each request's computed positions: (first position, input ids), in step order
        self._inputs: dict[str, list[tuple[int, np.ndarray | int]]] = {}
        # (step, request, its token ids)
        self._due: list[tuple[int, str, tuple[int, ...]]] = []

    def add(
        self, slots: torch.Tensor | None, planned: StepSlots, inputs: torch.Tensor | None = None
    ) -> StepGate:
        """Adds the step that just ran, on the calling thread after its drafter.

        ``slots``: its slot mapping, None when the step wrote no slots. ``planned``: where
        its slices must be. ``inputs``: its input ids, at least as many rows as the slot
        mapping (None: not checked)."""
        if slots is not None and inputs is not None:
            inputs = inputs[: slots.shape[0]] if inputs.shape[0] >= slots.shape[0] else None
        if slots is not None and slots.is_cuda:
            host = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True)
            host.copy_(slots, non_blocking=True)
            ids = None
            if inputs is not None:
                ids = torch.empty(inputs.shape, dtype=inputs.dtype, pin_memory=True)
                ids.copy_(inputs, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            # on the engine's current stream: after the drafter and the copies
            event.record()
            step = _Step(self._next, event, host, planned, ids)
        else:
            ids = inputs.to("cpu", copy=True) if inputs is not None and slots is not None else None
            step = _Step(self._next, HostDone(), slots, planned, ids)
        self._next += 1
        with self._lock:
            self._pending.append(step)
        return StepGate(self, step.seq)

    def compare_tokens(self, request_id: str, token_ids: tuple[int, ...], seq: int) -> None:
        """A sample ships ``token_ids`` from blocks written up to step ``seq``.

        Each of its positions computed in a checked step must have been computed from that
        token. A mismatch fails the sample, as a slot mismatch does."""
        with self._lock:
            if self._settled >= seq:
                self._compare(request_id, token_ids)
            else:
                self._due.append((seq, request_id, token_ids))

    def settle(self) -> dict[str, str]:
        """Check the steps that are done, in order, without waiting; returns the failures
        found since the last call (request id -> why)."""
        with self._lock:
            self._check_done(None)
            news, self._news = self._news, {}
        return news

    def status(self, seq: int, request_id: str) -> tuple[bool, str | None]:
        """(step ``seq`` checked, why ``request_id`` failed or None), without waiting."""
        with self._lock:
            self._check_done(seq)
            return self._settled >= seq, self.failed.get(request_id)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self.failed.pop(request_id, None)
            self._news.pop(request_id, None)
            self._inputs.pop(request_id, None)

    def _check_done(self, upto: int | None) -> None:
        while self._pending and (upto is None or self._pending[0].seq <= upto):
            step = self._pending[0]
            if not step.done.query():
                return
            self._pending.popleft()
            self._settled = step.seq
            if step.slots is not None and step.planned:
                slots = step.slots.numpy()
                # one sort serves both checks; a step of one-position slices needs none
                needed = bool(step.planned.spans) or step.inputs is not None
                ranked = sort_slots(slots) if needed else None
                for rid, why in check_step(slots, step.planned, self.block_size, ranked).items():
                    self._fail(rid, why)
                if step.inputs is not None:
                    self._keep_inputs(slots, step, ranked)
            if self._due:
                due = [d for d in self._due if d[0] <= step.seq]
                self._due = [d for d in self._due if d[0] > step.seq]
                for _, rid, tokens in due:
                    self._compare(rid, tokens)

    def _fail(self, rid: str, why: str) -> None:
        if rid not in self.failed:
            self.failed[rid] = why
            self._news[rid] = why

    def _keep_inputs(self, slots: np.ndarray, step: _Step, ranked: SortedSlots | None) -> None:
        """Each slice's input ids, from the row its first slot is in (a slice whose slots
        failed their check is failed already). One-position slices (decode steps) in one
        gather: a step may hold hundreds."""
        assert step.inputs is not None
        ids, ex, failed, kept = step.inputs.numpy(), step.planned, self.failed, self._inputs
        spans = ex.spans
        firsts = np.asarray(
            [*ex.firsts, *(e.blocks[0] * self.block_size + e.start % self.block_size for e in spans)],
            dtype=np.int64,
        )
        rows = first_rows(slots, firsts, ranked)
        ones = len(ex.firsts)
        if ones:
            got = ids[np.clip(rows[:ones], 0, None)].tolist()
            for (rid, p, _, _), row, tok in zip(ex.singles, rows[:ones].tolist(), got, strict=True):
                if row >= 0 and rid not in failed:
                    kept.setdefault(rid, []).append((p, tok))
        for e, row in zip(spans, rows[ones:].tolist(), strict=True):
            if row >= 0 and e.request_id not in failed:
                part = ids[row : row + e.num_tokens].astype(np.int64)
                kept.setdefault(e.request_id, []).append((e.start, part))

    def _compare(self, rid: str, tokens: tuple[int, ...]) -> None:
        """Fail ``rid`` if a position it ships was computed from another token.

        The last computation of each position counts, since its row is what the cache holds."""

        parts = self._inputs.pop(rid, None)
        if not parts or rid in self.failed:
            return
        want = np.asarray(tokens, dtype=np.int64)
        seen = np.full(len(want), -1, dtype=np.int64)
        for start, ids in parts:
            if isinstance(ids, int):
                if start < len(want):
                    seen[start] = ids
                continue
            end = min(start + len(ids), len(want))
            if end > start:
                seen[start:end] = ids[: end - start]
        off = np.flatnonzero((seen >= 0) & (seen != want))
        if off.size:
            named = ", ".join(f"{p} from {seen[p]} (ships {want[p]})" for p in off[:MAX_NAMED].tolist())
            self._fail(
                rid,
                f"token check: {off.size} position(s) were computed from other tokens than the sample's "
                f"token ids: position {named}",
            )


class StepGate:
    """May the blocks a step wrote be read yet? (``sender.ReadyGate``)"""

    def __init__(self, checks: SlotChecks, seq: int) -> None:
        self._checks = checks
        self.seq = seq

    def poll(self, request_id: str) -> tuple[bool, str | None]:
        """(the step is done on the device and checked, why the request failed or None)."""
        return self._checks.status(self.seq, request_id)
