"""The CPU time a connector's hooks spend on the thread that calls them: vLLM's engine
thread (scheduler side) and its worker's thread (worker side), hook by hook.

``HookTimes.wrap`` puts a timer around each of vLLM's connector hooks that an instance
has (our connector or the bench's raw one alike); each call adds the calling thread's CPU
time (``time.thread_time_ns``: what the engine's own thread pays, not the connector's
background threads) to its hook's total. ``take`` returns the totals since the last take
and starts new ones, less the timer's own cost (``timer_ns``: about a microsecond a call
on the thread, measured when the timer is made, on an empty hook).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

# vLLM's KVConnectorBase_V1 hooks, by the side that calls them
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "get_kv_connector_stats",
)
WORKER_HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    "get_kv_connector_stats",
)


class HookTimes:
    """Thread CPU nanoseconds per hook (``"scheduler.build_connector_meta"``, ...) of the
    connector instances wrapped."""

    def __init__(self) -> None:
        self.ns: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._hooks: set[str] = set()  # the wrapped hooks' keys
        self.timer_ns = self._calibrate()

    def _calibrate(self, calls: int = 5000) -> int:
        """The thread CPU time a timed call of an empty hook is charged: the timer's own
        cost inside its reading (the median of ten rounds)."""
        probe = self._timed(_empty, "probe")
        rounds = []
        for _ in range(10):
            for _ in range(calls // 10):
                probe()
            rounds.append(self.ns.pop("probe") // self.calls.pop("probe"))
        return sorted(rounds)[len(rounds) // 2]

    def wrap(self, connector: Any, side: str) -> None:
        """Time ``connector``'s hooks of ``side`` (``"scheduler"`` or ``"worker"``)."""
        hooks = SCHEDULER_HOOKS if side == "scheduler" else WORKER_HOOKS
        for hook in hooks:
            method = getattr(connector, hook, None)
            if method is not None:
                setattr(connector, hook, self._timed(method, f"{side}.{hook}"))
                self._hooks.add(f"{side}.{hook}")

    def _timed(self, method: Callable[..., Any], key: str) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return method(*args, **kwargs)
            finally:
                self.ns[key] += time.thread_time_ns() - t0
                self.calls[key] += 1

        return timed

    def add(self, key: str, ns: int) -> None:
        """Time the harness measured itself (vLLM's pickling of the metadata, ...)."""
        self.ns[key] += ns
        self.calls[key] += 1

    def take(self) -> dict[str, int]:
        """Nanoseconds per hook since the last take, less the timer's cost of its calls
        (``add``'s figures are the harness's own: nothing taken off); the totals start again."""
        timer = self.timer_ns
        out = {k: max(0, ns - timer * self.calls[k]) if k in self._hooks else ns for k, ns in self.ns.items()}
        self.ns.clear()
        self.calls.clear()
        return out


def _empty() -> None:
    """The hook the timer is calibrated on."""


def per_unit_us(totals: dict[str, int], units: float) -> dict[str, float]:
    """``totals`` (ns) in microseconds per unit (a step, a thousand tokens), with their sum
    as ``"total"``."""
    out = {key: round(ns / units / 1e3, 1) for key, ns in sorted(totals.items()) if ns}
    out["total"] = round(sum(totals.values()) / units / 1e3, 1)
    return out
