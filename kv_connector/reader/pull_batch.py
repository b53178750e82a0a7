"""The pull client's batched fetching (``PullClient.fetch_iter`` and ``fetch_many``): the
samples of many handles, with up to ``in_flight`` of them asked for and READ ahead on the
caller's thread while each one READ is checked (its checksum, its values) and released
at its producer on the client's checker thread, one of its own (a READ copies on the
thread that posts it; the checks, XXH3 and the values check, run without the GIL).

``Checker`` is that thread, made on first use and ended by the client's ``close``;
``fetch_iter`` is the pipeline, given the client's two halves of one fetch: ``start``
(ask every rank, take pages, post the READs) and ``finish`` (wait, check, release,
hand out).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from kv_connector.common.device import on_device
from kv_connector.reader.lease import Sample
from kv_connector.reader.pull_links import FetchError

Pending = TypeVar("Pending")  # the client's fetch under way, between its two halves
Handle = str | Mapping[str, Any]


class Checker:
    """The client's checker thread (one; checks run one at a time beside the READs),
    made on first use on the client's device."""

    def __init__(self, name: str, device: torch.device) -> None:
        self._name = name
        self._device = device
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, f"{self._name}-check", initializer=on_device, initargs=(self._device,)
                )
            return self._pool

    def close(self) -> None:
        """End the thread once the checks submitted are done (a later use makes another)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def fetch_iter(
    start: Callable[[Handle], Pending],
    finish: Callable[[Pending], Sample],
    checker: Checker,
    handles: Iterable[Handle],
    in_flight: int | None,
) -> Iterator[Sample | FetchError]:
    """The samples of ``handles`` in their order, each a ``Sample`` or the ``FetchError``
    of that one, with up to ``in_flight`` of them started ahead (None: all); each is
    finished on ``checker``'s thread. Left early, the samples started ahead are finished
    and released (their pages go back)."""
    if in_flight is not None and in_flight < 1:
        raise ValueError(f"in_flight must be at least 1, got {in_flight}")
    executor = checker.executor()
    pending: collections.deque[concurrent.futures.Future[Sample] | FetchError] = collections.deque()
    try:
        for h in handles:
            try:
                pending.append(executor.submit(finish, start(h)))
            except FetchError as e:
                pending.append(e)
            if in_flight is not None and len(pending) >= in_flight:
                yield _outcome(pending.popleft())
        while pending:
            yield _outcome(pending.popleft())
    finally:  # left early: the samples read ahead give their pages back
        for p in pending:
            got = _outcome(p)
            if isinstance(got, Sample):
                got.release()


def _outcome(p: concurrent.futures.Future[Sample] | FetchError) -> Sample | FetchError:
    if isinstance(p, FetchError):
        return p
    try:
        return p.result()
    except FetchError as e:
        return e
