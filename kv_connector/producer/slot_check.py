"""The step's barrier and its slot-mapping check, off the step's critical path.

The engine never waits for the device here. At the end of a step (after the drafter, which
wrote the hidden states) the worker side hands ``SlotChecks.add`` the slot mapping the
cache-only layer wrote with: on a GPU it is copied to pinned host memory asynchronously
and an event is recorded after the copy, on the engine's stream (so after the drafter);
on CPU a stand-in that is always done takes its place and the same code runs. A step is
checked (``planning.check_step``) once its event is done, in step order, by whoever asks
first: the worker side at its next hook, or a sender thread asking a ``StepGate`` whether
a request's blocks may be read. Until then nothing reads them: the sender holds the
request's job (no credit request, no digest, no WRITE).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from kv_connector.common.device import DeviceEvent, HostDone
from kv_connector.producer.planning import StepExpect, check_step


@dataclass
class _Step:
    seq: int
    done: DeviceEvent
    slots: torch.Tensor | None  # on the host once ``done``
    expected: StepExpect


class SlotChecks:
    """Every step's slot mapping on its way to the host, checked in step order once it
    arrives. ``failed`` keeps each request's first failure until ``forget``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pending: deque[_Step] = deque()
        self._next = 0
        self._settled = -1  # the last step checked
        self._news: dict[str, str] = {}  # failures found since ``settle`` last returned them

    def add(self, slots: torch.Tensor | None, expected: StepExpect) -> StepGate:
        """The step that just ran (on the calling thread, after its drafter): its slot
        mapping (None when the step wrote no slots) and where its slices must be."""
        if slots is not None and slots.is_cuda:
            host = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True)
            host.copy_(slots, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()  # on the engine's current stream: after the drafter and the copy
            step = _Step(self._next, event, host, expected)
        else:
            step = _Step(self._next, HostDone(), slots, expected)
        self._next += 1
        with self._lock:
            self._pending.append(step)
        return StepGate(self, step.seq)

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

    def _check_done(self, upto: int | None) -> None:
        while self._pending and (upto is None or self._pending[0].seq <= upto):
            step = self._pending[0]
            if not step.done.query():
                return
            self._pending.popleft()
            self._settled = step.seq
            if step.slots is None or not step.expected:
                continue
            for rid, why in check_step(step.slots.numpy(), step.expected, self.block_size).items():
                if rid not in self.failed:
                    self.failed[rid] = why
                    self._news[rid] = why


class StepGate:
    """May the blocks a step wrote be read yet? (``sender.ReadyGate``)"""

    def __init__(self, checks: SlotChecks, seq: int) -> None:
        self._checks = checks
        self.seq = seq

    def poll(self, request_id: str) -> tuple[bool, str | None]:
        """(the step is done on the device and checked, why the request failed or None)."""
        return self._checks.status(self.seq, request_id)
