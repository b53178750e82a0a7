"""``make bench``'s ``engine_thread_us`` (``scripts.bench.step``, ``scripts.bench.hook_time``):
the CPU time each connector hook spends on the thread that calls it, per decode step and
per thousand prefill tokens, for our connector and the bench's raw one, at tiny sizes."""

from __future__ import annotations

import threading
import time

from scripts.bench import step
from scripts.bench.hook_time import HookTimes, per_unit_us


class Hooks:
    def wait_for_save(self) -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.002:  # 2 ms of this thread's CPU
            pass

    def get_finished(self, ids: set[str]) -> tuple[None, None]:
        time.sleep(0.01)  # waiting costs the thread no CPU
        return None, None

    def clear_connector_metadata(self) -> None:
        """Nothing: what it is charged is the timer's own cost, taken off."""


def test_each_hook_is_charged_the_cpu_of_the_thread_that_called_it_and_a_take_starts_again() -> None:
    hooks, times = Hooks(), HookTimes()
    times.wrap(hooks, "worker")
    spinner = threading.Thread(target=lambda: time.sleep(0) or [0 for _ in range(10**6)])
    spinner.start()  # another thread's CPU is not this hook's
    hooks.wait_for_save()
    assert hooks.get_finished(set()) == (None, None)
    spinner.join()
    for _ in range(1000):
        hooks.clear_connector_metadata()
    taken = times.take()
    assert 1.5e6 < taken["worker.wait_for_save"] < 20e6
    assert taken["worker.get_finished"] < 1e6
    assert 0 < times.timer_ns < 50_000  # the timer's cost a call, measured on an empty hook
    assert taken.get("worker.clear_connector_metadata", 0) < 500 * times.timer_ns  # taken off
    assert times.take() == {}
    assert per_unit_us({"a": 3000, "b": 1000}, 2) == {"a": 1.5, "b": 0.5, "total": 2.0}


def test_the_figures_name_each_hook_of_ours_and_of_the_raw_connector() -> None:
    """Ours per decode step with output tokens, the raw connector's per thousand prefill
    tokens (each in a process of its own: the harness runs one vLLM rank a process)."""
    ours = step.in_process(step.measure, 2048, 32, 4)["engine_thread_us"]
    raw = step.in_process(step.prefill, True, rounds=1)
    # every decoding request's new slot is shipped: the scheduler plans it, the worker takes it
    assert ours["scheduler.build_connector_meta"] > 0 and ours["worker.wait_for_save"] > 0
    assert ours["engine.metadata_pickle"] > 0
    assert ours["total"] >= ours["worker.wait_for_save"] + ours["scheduler.build_connector_meta"]
    # a prompt's blocks leave at its prefill's end
    assert raw["worker.wait_for_save"] > 0 and raw["scheduler.build_connector_meta"] > 0
    sides = ("engine", "scheduler", "worker")
    for figures in (ours, raw):
        assert all(key == "total" or key.split(".")[0] in sides for key in figures)
