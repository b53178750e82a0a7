"""Counts the host syncs inside the connector's worker hooks on a GPU, when asked.

A hook that waits for the GPU stalls vLLM's step, and CUDA graphs and async scheduling
hide no such wait. ``KV_CONNECTOR_SYNC_CHECK=1`` turns on torch's sync debug mode ("warn")
for the length of each hook and counts the warnings it raises there. Each new count is
logged with the hook and the operation. The mode is global to the process, so a sync by
another thread during a hook counts too. Off by default; it costs nothing then.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

log = logging.getLogger("kv_connector.producer")

ENV = "KV_CONNECTOR_SYNC_CHECK"
# the worker hooks the connector forwards to its WorkerSide
HOOKS = frozenset(
    {
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "handle_preemptions",
        "wait_for_save",
        "get_finished",
        "build_connector_worker_meta",
    }
)
# torch's words: "called a synchronizing CUDA operation"
SYNC_WARNING = "synchroniz"

SetMode = Callable[[str | int], None]


def requested() -> bool:
    """Whether ``KV_CONNECTOR_SYNC_CHECK`` asks for the count, on a process that has CUDA."""
    return os.environ.get(ENV, "0") == "1" and torch.cuda.is_available()


class SyncWatch:
    """Each hook's host syncs so far (``counts``); ``rank`` says whose (known once the
    caches are registered); ``set_mode`` is torch's setter (a test passes its own)."""

    def __init__(self, rank: Callable[[], int], set_mode: SetMode | None = None) -> None:
        self._rank = rank
        self.counts: dict[str, int] = {}
        self._set_mode: SetMode = set_mode or torch.cuda.set_sync_debug_mode
        log.info("counting host syncs inside the connector's hooks (%s=1)", ENV)

    @contextlib.contextmanager
    def hook(self, name: str) -> Iterator[None]:
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:  # type: ignore[assignment]
                warnings.simplefilter("always")
                self._set_mode("warn")
                try:
                    yield
                finally:
                    self._set_mode("default")
        # a hook that raised is counted too
        finally:
            self._count(name, caught)

    def _count(self, name: str, caught: list[warnings.WarningMessage]) -> None:
        syncs = [w for w in caught if SYNC_WARNING in str(w.message)]
        # the hook's other warnings, as they would have been shown
        for w in caught:
            if w not in syncs:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if syncs:
            n = self.counts[name] = self.counts.get(name, 0) + len(syncs)
            where = f"{syncs[0].filename}:{syncs[0].lineno}"
            log.warning(
                "rank %d: host sync inside the connector's %s (%d so far): %s at %s",
                self._rank(),
                name,
                n,
                syncs[0].message,
                where,
            )


class Watched:
    """A worker side whose hooks run inside ``watch.hook``; every other attribute as is."""

    def __init__(self, target: Any, watch: SyncWatch) -> None:
        self._target = target
        self._watch = watch

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in HOOKS or not callable(attr):
            return attr
        watch = self._watch

        def call(*args: Any, **kwargs: Any) -> Any:
            with watch.hook(name):
                return attr(*args, **kwargs)

        return call
