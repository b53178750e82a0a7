"""The delivery modes' scheduler parts and the worker side, without vLLM: push admits once
every rank reaches a request's reader, pull once every rank reported its endpoint; the
worker side hands a step's complete requests to its mode and returns them to vLLM once the
mode settled them and the scheduler said they finished."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kv_connector.cache.blocks import Fingerprinted
from kv_connector.producer import modes
from kv_connector.producer.delivery import DeliveryBook
from kv_connector.producer.mode import (
    Finished,
    HandsOutHandles,
    HoldsSamples,
    ReleasesCache,
    SendsToReaders,
    Settled,
)
from kv_connector.producer.options import ConnectorOptions
from kv_connector.producer.planning import BlockRecorder, NewRequest, ShipOrder, ShipPlanner
from kv_connector.producer.pull.mode import EndHolds, PullScheduling, PullWorker, Serving
from kv_connector.producer.push.mode import PushScheduling, PushWorker
from kv_connector.producer.slot_check import SlotChecks, StepGate
from kv_connector.producer.worker_report import LinkChange, WorkerReport
from kv_connector.producer.worker_side import WorkerSide
from kv_connector.wire.failure import FailureReason, SampleFailure
from kv_connector.wire.handle import decode_handle, make_nonce
from kv_connector.wire.identity import NO_IDENTITY
from kv_connector.wire.outcome import SampleStatus


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def finished(rid: str, status: SampleStatus = SampleStatus.PENDING, **kw: Any) -> Finished:
    fields: dict[str, Any] = dict(
        request_id=rid, identity=NO_IDENTITY, hold=True, status=status, error="", aborted=False,
    )  # fmt: skip
    return Finished(**{**fields, **kw})


# ------------------------------------------------------------------ pull, scheduler side


def pull(world: int = 2) -> tuple[PullScheduling, DeliveryBook, Clock]:
    clock = Clock()
    book = DeliveryBook(5.0, clock=clock)
    return PullScheduling(ConnectorOptions.parse({"delivery": "pull"}), book, "p", world), book, clock


def test_pull_admits_once_every_rank_reported_its_endpoint_and_needs_no_reader() -> None:
    mode, book, _ = pull()
    book.add("r")
    mode.on_new_request("r")
    assert mode.admit("r").kind == "wait" and mode.reachable() == 0
    mode.update(WorkerReport(news=[Serving(0, "127.0.0.1:9000")]))
    assert mode.admit("r").kind == "wait"  # rank 1 not yet
    mode.update(WorkerReport(news=[Serving(1, "127.0.0.1:9001")]))
    a = mode.admit("r")
    assert (a.kind, a.reader) == ("run", None) and mode.reachable() == 1
    assert mode.started("r") is None  # admitted the usual way: nothing to bind


def test_pull_fails_a_request_whose_ranks_never_reported_an_endpoint_naming_them() -> None:
    mode, book, clock = pull(world=3)
    book.add("r")
    mode.update(WorkerReport(news=[Serving(1, "127.0.0.1:9001")]))
    assert mode.admit("r").kind == "wait"
    clock.t += 5.1
    a = mode.admit("r")
    assert a.kind == "fail" and a.failure is not None and a.failure.reason is FailureReason.UNREACHABLE
    assert "[0, 2]" in a.why and "5 s" in a.why
    assert book.outcome("r") == (SampleStatus.FAILED, a.why)


def test_pull_hands_out_a_handle_naming_every_rank_endpoint_in_rank_order() -> None:
    mode, book, _ = pull()
    book.add("r")
    mode.on_new_request("r")
    mode.update(WorkerReport(news=[Serving(1, "127.0.0.1:9001"), Serving(0, "127.0.0.1:9000")]))
    mode.on_new_request("other")
    nonce = mode.route("r")  # what every rank holds its sample under
    assert nonce is not None and len(nonce) == len(make_nonce()) and nonce != mode.route("other")
    params = mode.request_finished(finished("r"))
    handle = decode_handle(params["handle"])
    assert handle.endpoints == ["127.0.0.1:9000", "127.0.0.1:9001"] and handle.nonce == nonce
    assert params["hidden_states"]["status"] == "ready" and mode.news() is None
    assert mode.route("r") is None  # forgotten at its finish


@pytest.mark.parametrize("aborted", [False, True])
def test_a_failed_or_aborted_pull_request_gets_no_handle_and_its_hold_ends(aborted: bool) -> None:
    mode, _, _ = pull(world=1)
    mode.update(WorkerReport(news=[Serving(0, "127.0.0.1:9000")]))
    status = SampleStatus.PENDING if aborted else SampleStatus.FAILED
    params = mode.request_finished(finished("r", status, error="wrote no slots", aborted=aborted))
    assert "handle" not in params and params["hidden_states"]["status"] == "failed"
    assert params["hidden_states"]["error"] == ("the request was aborted" if aborted else "wrote no slots")
    assert mode.news() == EndHolds(("r",)) and mode.news() is None


def test_a_pull_request_vllm_ran_before_admitting_it_is_bound_then() -> None:
    mode, book, _ = pull(world=1)
    book.add("early")
    assert mode.admit("early").kind == "wait"
    assert mode.started("early") is not None  # scheduled anyway: held like any other
    assert mode.admit("early").kind == "run" and mode.started("early") is None


# ------------------------------------------------------------------ push, scheduler side

R0, R1 = "10.0.0.1:7000", "10.0.0.2:7000"


def push(readers: Sequence[str] = (R0,), world: int = 1, **extra: Any) -> tuple[PushScheduling, DeliveryBook]:
    book = DeliveryBook(5.0, clock=Clock())
    options = ConnectorOptions.parse({"consumer_address": list(readers), **extra})
    return PushScheduling(options, book, "p", world), book


def test_push_admits_once_every_rank_reaches_the_request_reader() -> None:
    mode, book = push(world=2)
    book.add("r")
    assert mode.admit("r").kind == "wait"
    mode.update(WorkerReport(links=[LinkChange(R0, 0, None)]))
    assert mode.admit("r").kind == "wait" and mode.reachable() == 0
    mode.update(WorkerReport(links=[LinkChange(R0, 1, None)]))
    a = mode.admit("r")
    assert (a.kind, a.reader) == ("run", R0) and mode.reachable() == 1
    mode.update(WorkerReport(links=[LinkChange(R0, 1, "reset by peer")]))
    assert mode.reachable() == 0 and mode.admit("r").kind == "run"  # admitted once: runs


def test_push_names_the_reader_in_the_outcome_and_a_failed_request_its_bound_one() -> None:
    mode, book = push(readers=(R0, R1))
    book.add("ok")
    book.run("ok", R1)  # bound at admission
    assert mode.route("ok") == R1  # its ship orders name that reader
    params = mode.request_finished(finished("ok", SampleStatus.DELIVERED))
    assert params["hidden_states"]["consumer_address"] == R1
    params = mode.request_finished(finished("bad id", SampleStatus.FAILED, error="cannot name a sample"))
    assert params["hidden_states"]["consumer_address"] == mode.admission.router.route("bad id")
    assert mode.request_finished(finished("later"))["hidden_states"]["consumer_address"] is None
    rr, _ = push(readers=(R0, R1), sharding="round_robin")
    params = rr.request_finished(finished("x", SampleStatus.FAILED))
    assert params["hidden_states"]["consumer_address"] is None


# ------------------------------------------------------------------ worker side

BS = 4


class FakeMode:
    """A worker mode that records what the worker side asks of it."""

    def __init__(self) -> None:
        self.shipped: list[tuple[str, list[int], bool]] = []
        self.refused: dict[str, str] = {}
        self.told_finished: set[str] = set()
        self.to_settle = Settled()

    def describe(self) -> str:
        return "fake"

    def ship(
        self, order: ShipOrder, blocks: list[int], gate: StepGate | None, told_finished: bool,
        words: Fingerprinted | None,
    ) -> None:  # fmt: skip
        self.shipped.append((order.request_id, blocks, told_finished))

    def refuse(self, order: ShipOrder, why: str) -> None:
        self.refused[order.request_id] = why

    def fail_held(self, request_id: str, why: str) -> bool:
        self.refused[request_id] = why
        return True

    def hear(self, news: object) -> None:
        pass

    def preempt(self, request_ids: Sequence[str], shipped: set[str]) -> dict[str, SampleFailure]:
        busy = [rid for rid in request_ids if rid in shipped]
        return {rid: SampleFailure(FailureReason.PREEMPTED, "preempted") for rid in busy}

    def finished(self, request_ids: set[str]) -> None:
        self.told_finished |= request_ids

    def settle(self) -> Settled:
        out, self.to_settle = self.to_settle, Settled()
        return out

    def link_changes(self) -> tuple[list[LinkChange], list[object]]:
        return [], [Serving(0, "127.0.0.1:9000")]

    def close(self, drain_timeout_s: float) -> None:
        pass


def worker() -> tuple[WorkerSide, FakeMode]:
    options = ConnectorOptions.parse({"delivery": "pull", "check_tokens": False})
    mode = FakeMode()
    side = WorkerSide(SimpleNamespace(), options, "p", [1, 2], make_mode=lambda o, rc: mode)  # type: ignore[arg-type]
    side.mode, side.recorder, side.checks = mode, BlockRecorder(BS), SlotChecks(BS)
    return side, mode


def wrote(side: WorkerSide, slots: torch.Tensor) -> None:
    """The step's cache-only layer wrote with ``slots``, as vLLM's forward tells the worker side."""
    side.save_kv_layer(side.layer_name, SimpleNamespace(slot_mapping=slots))


def slots_for(table: Sequence[int], n: int) -> torch.Tensor:
    return torch.tensor([table[p // BS] * BS + p % BS for p in range(n)], dtype=torch.int64)


def test_the_worker_side_ships_a_written_request_and_returns_it_once_settled_and_finished() -> None:
    side, mode = worker()
    planner = ShipPlanner()
    planner.add("r")
    prompt, table = list(range(10, 16)), [5, 2]
    plan = planner.plan([NewRequest("r", prompt, table, 0)], [], {"r": len(prompt)})
    wrote(side, slots_for(table, len(prompt)))
    side.wait_for_save(plan)
    assert mode.shipped == [("r", table, False)] and not mode.refused
    assert side.get_finished(set()) is None  # not settled, not finished
    mode.to_settle = Settled(done={"r"}, delivered={"r"})
    assert side.get_finished(set()) is None  # settled, but vLLM has not finished it yet
    assert side.get_finished({"r"}) == {"r"} and mode.told_finished == {"r"}
    report = side.build_connector_worker_meta()
    assert report.delivered == {"r"} and report.news == [Serving(0, "127.0.0.1:9000")] and not report.failures


def test_the_worker_side_refuses_a_request_written_elsewhere_and_reports_why() -> None:
    side, mode = worker()
    planner = ShipPlanner()
    planner.add("r")
    prompt, table = list(range(6)), [5, 2]
    plan = planner.plan([NewRequest("r", prompt, table, 0)], [], {"r": len(prompt)})
    wrote(side, slots_for([5, 3], len(prompt)))  # the second block went to block 3, not 2
    side.wait_for_save(plan)
    assert not mode.shipped and "r" in mode.refused
    report = side.build_connector_worker_meta()
    assert set(report.failures) == {"r"} and report.failures["r"].why == mode.refused["r"]
    assert side.get_finished({"r"}) == {"r"}  # its blocks go back to vLLM at its finish


def test_the_worker_side_reports_a_preempted_shipped_request_as_failed() -> None:
    side, mode = worker()
    planner = ShipPlanner()
    planner.add("r")
    plan = planner.plan([NewRequest("r", [1, 2, 3], [7], 0)], [], {"r": 3})
    assert not mode.shipped
    wrote(side, slots_for([7], 3))
    side.wait_for_save(plan)
    side.handle_preemptions(SimpleNamespace(preempted=["r"]))  # type: ignore[arg-type]
    assert side.build_connector_worker_meta().failures["r"].reason is FailureReason.PREEMPTED


# ------------------------------------------------------------------ the modes' seam


def test_each_mode_has_the_capabilities_it_acts_on_and_no_other() -> None:
    # pull holds samples for consumers; push releases the cache in sleep mode and sends to readers
    assert issubclass(PullWorker, HoldsSamples) and not issubclass(PushWorker, HoldsSamples)
    assert issubclass(PushWorker, ReleasesCache) and not issubclass(PullWorker, ReleasesCache)
    assert issubclass(PushWorker, SendsToReaders) and not issubclass(PullWorker, SendsToReaders)
    assert issubclass(PullScheduling, HandsOutHandles) and not issubclass(PushScheduling, HandsOutHandles)


def test_a_worker_side_asks_its_mode_for_capabilities_once_and_skips_what_it_lacks() -> None:
    side, mode = worker()
    assert side.holds is mode and side.releases is None and side.readers is None
    side.unregister_kv_caches()  # a mode that keeps the cache registered: not asleep
    assert not side.asleep and side.wait_connected(0.0)  # consumers come to it: connected at once


def test_the_shared_sides_import_neither_delivery_mode() -> None:
    code = (
        "import sys, kv_connector.producer.worker_side, kv_connector.producer.scheduler_side\n"
        "print(' '.join(m for m in sys.modules if m.startswith(('kv_connector.producer.push', "
        "'kv_connector.producer.pull', 'kv_connector.sender.sender', 'kv_connector.sender.loop'))))"
    )
    argv = [sys.executable, "-c", code]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == []
    # the one module that knows both makes each
    assert modes.scheduler_mode.__module__ == "kv_connector.producer.modes"


class Later:
    """A device event stand-in that is done only once ``Later.done`` says so (a GPU step's)."""

    done = False

    def query(self) -> bool:
        return Later.done

    def synchronize(self) -> None:
        Later.done = True


def test_a_held_sample_whose_step_fails_its_check_a_step_late_has_its_hold_failed_and_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kv_connector.producer import slot_check

    monkeypatch.setattr(slot_check, "HostDone", Later)
    Later.done = False
    side, mode = worker()
    planner = ShipPlanner()
    planner.add("r")
    prompt, table = list(range(6)), [5, 2]
    plan = planner.plan([NewRequest("r", prompt, table, 0)], [], {"r": len(prompt)})
    wrote(side, slots_for([5, 3], len(prompt)))  # written to block 3, not 2: found a step late
    side.wait_for_save(plan)
    assert mode.shipped == [("r", table, False)] and not mode.refused  # held, its check pending
    Later.done = True
    assert side.get_finished(set()) is None
    assert "r" in mode.refused and "block" in mode.refused["r"]  # its hold was failed
    report = side.build_connector_worker_meta()
    assert set(report.failures) == {"r"} and report.failures["r"].why == mode.refused["r"]
