"""Check b of the device tier: the producer's step path, without vLLM, on the device.

What the worker side does each step (``producer.worker_side.WorkerSide.wait_for_save``),
driven by hand on a cache and slot mappings that live on ``device``:

- the "forward pass" writes each step's states into the cache at its slot mapping (padded
  with -1 rows, as vLLM pads a step for a CUDA graph), behind a kernel that keeps the
  device busy for a while on the first step;
- ``BlockRecorder.slots_of`` (where each slice must have been written), ``SlotChecks.add``
  (the slot mapping copied to the host asynchronously, an event recorded after it),
  ``SlotChecks.settle`` and ``StepGate.poll`` (what a sender asks before it reads a
  request's blocks), all on the engine's thread;
- a request whose slots landed in a block its table does not name, which the checks must
  fail by name once its step is done on the device.

On a GPU all of it runs under ``torch.cuda.set_sync_debug_mode("error")``: any host sync
on that path raises, and the check fails. Afterwards (syncs allowed again) every request's
states are read back through the blocks the recorder ships and compared byte for byte
with what the forward pass wrote.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_connector.producer.planning import BlockRecorder, StepSlice
from kv_connector.producer.slot_check import SlotChecks, StepGate

BLOCK = 16
LAYERS = 4
HIDDEN = 256
NUM_BLOCKS = 256
PAD_ROWS = 5  # -1 rows at the end of a step's slot mapping (a CUDA graph's padding)
BUSY_CYCLES = 200_000_000  # ~0.1 s of a GPU's clock: the first step is still running when polled

# (request, start, tokens) per step: chunked prefills, single-token decodes, a 1-token prompt
STEPS: list[list[tuple[str, int, int]]] = [
    [("a", 0, 64), ("b", 0, 20), ("c", 0, 1)],
    [("a", 64, 36), ("b", 20, 1), ("c", 1, 1)],
    [("a", 100, 1), ("b", 21, 1), ("d", 0, 33)],
    [("a", 101, 1), ("d", 33, 1)],
]
WRONG = "wrong"  # the request whose slots miss its table


@dataclass
class _Request:
    table: list[int]
    sent: int = 0  # how much of its table the plans sent
    written: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> its states


@contextlib.contextmanager
def _no_host_sync(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


Step = tuple[list[StepSlice], torch.Tensor, torch.Tensor]  # slices, slot mapping, states


def _plan(device: torch.device) -> tuple[dict[str, _Request], list[Step]]:
    """The requests, and each step's slices, slot mapping and states, prepared on the
    device before the timed part (vLLM's slot mapping is on the device before the step)."""
    rng = random.Random(7)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    reqs: dict[str, _Request] = {}
    gen = torch.Generator().manual_seed(7)
    steps = []
    wrong_step = [(WRONG, 0, 40)]
    for step in [*STEPS, wrong_step]:
        slices, slots = [], []
        for rid, start, n in step:
            r = reqs.setdefault(rid, _Request([]))
            while len(r.table) * BLOCK < start + n:
                r.table.append(free.pop())
            slices.append(StepSlice(rid, start, n, tuple(r.table[r.sent :]), r.sent))
            r.sent = len(r.table)
            for p in range(start, start + n):
                block = r.table[p // BLOCK]
                if rid == WRONG and p // BLOCK == 1:
                    block = free[0]  # written to a block the table does not name
                slots.append(block * BLOCK + p % BLOCK)
        slots += [-1] * PAD_ROWS
        states = torch.randn(len(slots), LAYERS, HIDDEN, generator=gen).to(torch.bfloat16)
        for (rid, start, n), row in zip(step, _rows(step), strict=True):
            for k in range(n):
                reqs[rid].written[start + k] = states[row + k]
        slot_t = torch.tensor(slots, dtype=torch.int64).to(device)
        steps.append((slices, slot_t, states.to(device)))
    return reqs, steps


def _rows(step: list[tuple[str, int, int]]) -> list[int]:
    rows, at = [], 0
    for _rid, _start, n in step:
        rows.append(at)
        at += n
    return rows


def check(device: torch.device) -> dict[str, Any]:
    reqs, steps = _plan(device)
    cache = torch.zeros(NUM_BLOCKS, BLOCK, LAYERS, HIDDEN, dtype=torch.bfloat16, device=device)
    flat = cache.view(-1, LAYERS, HIDDEN)
    recorder, checks = BlockRecorder(BLOCK), SlotChecks(BLOCK)
    gates: list[tuple[StepGate, list[str]]] = []
    engine_us: list[float] = []
    first_polls: list[bool] = []
    failures: dict[str, str] = {}
    done_after_s = 0.0
    phases_ms: dict[str, float] = {}
    # the forward's kernel once before: vLLM's warm-up runs its kernels before serving, and a
    # kernel's first launch loads its module, which waits for the device (CUDA's lazy loading)
    _, slots0, states0 = steps[0]
    flat.clone().index_copy_(0, slots0[: len(slots0) - PAD_ROWS], states0[: len(slots0) - PAD_ROWS])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with _no_host_sync(device):
        t_busy = time.perf_counter()
        for i, (slices, slots, states) in enumerate(steps):
            if i == 0 and device.type == "cuda":
                torch.cuda._sleep(BUSY_CYCLES)  # the device is still busy when the engine asks
            # the forward pass: the cache-only layer writes at the slot mapping, pads skipped
            rows = len(slots) - PAD_ROWS
            flat.index_copy_(0, slots[:rows], states[:rows])
            t0 = time.perf_counter()
            planned, errors = recorder.slots_of(slices)
            gate = checks.add(slots, planned)
            failures.update(checks.settle())
            engine_us.append((time.perf_counter() - t0) * 1e6)
            failures.update(errors)
            rids = [sl.request_id for sl in slices]
            first_polls.append(gate.poll(rids[0])[0])
            if i == 0:
                phases_ms = {
                    "forward_queued": (t0 - t_busy) * 1e3,
                    "engine_done": (t0 - t_busy) * 1e3 + engine_us[0] / 1e3,
                    "first_poll": (time.perf_counter() - t_busy) * 1e3,
                }
            gates.append((gate, rids))
        t_wait = time.perf_counter()
        deadline = t_wait + 60
        while not all(g.poll(rid)[0] for g, rids in gates for rid in rids):
            if time.perf_counter() > deadline:
                raise AssertionError("the steps' events were not done within 60 s")
            time.sleep(0.001)
        done_after_s = time.perf_counter() - t_wait
        for g, rids in gates:
            for rid in rids:
                why = g.poll(rid)[1]
                if why is not None:
                    failures[rid] = why
        failures.update(checks.settle())
    if device.type == "cuda" and first_polls[0]:
        raise AssertionError(
            "a step still running on the device was reported done: the event is not after it, "
            f"or the host waited for the device (ms after the busy kernel's launch: {phases_ms}; "
            f"the steps' events all done {done_after_s * 1e3:.1f} ms after the last step; "
            f"engine us per step {[round(u) for u in engine_us]})"
        )
    if set(failures) != {WRONG}:
        raise AssertionError(
            f"the slot checks failed {sorted(failures)}, expected only {WRONG!r}: {failures}"
        )
    compared = 0
    for rid, r in reqs.items():
        if rid == WRONG:
            continue
        n = len(r.written)
        blocks = recorder.ship_blocks(n, r.table)
        got = cache[torch.tensor(blocks, device=device)].reshape(-1, LAYERS, HIDDEN)[:n].cpu()
        want = torch.stack([r.written[p] for p in range(n)])
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            raise AssertionError(f"request {rid}: the states in its shipped blocks differ from those written")
        compared += n
    return {
        "sync_debug_mode": "error" if device.type == "cuda" else "n/a on cpu",
        "steps": len(steps),
        "tokens_compared": compared,
        "wrong_slots_caught": failures[WRONG],
        "first_poll_done": first_polls[0],
        "ms_after_busy_launch": phases_ms,
        "steps_done_after_s": done_after_s,
        "engine_us_per_step_max": max(engine_us),
        "engine_us_per_step_median": sorted(engine_us)[len(engine_us) // 2],
    }
