"""The pull client's batched fetching (``PullClient.fetch_iter`` and ``fetch_many``).

It fetches the samples of many handles, with up to ``in_flight`` of them READ ahead on the
caller's thread. Meanwhile the client's asker thread asks for the next one. That round
trip overlaps the READ being posted, since a READ copies on the thread that posts it. The
client's checker thread checks each sample READ (its record, its values) and releases it
at its producer. Both threads are the client's own, made on first use and ended by its
``close``. The checks and UCX's copies run without the GIL.

``fetch_iter`` is the pipeline, given the client's ``Stages`` of one fetch. ``ask`` gets
every rank's share and leaves the hold unchanged. ``post`` takes pages and posts the READs.
``finish`` waits, checks, releases and hands out.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from kv_connector.common.device import on_device
from kv_connector.common.errors import ConfigurationError
from kv_connector.reader.pool.lease import Sample
from kv_connector.reader.pull.links import FetchError

# a sample whose shares the ranks gave, nothing READ yet
Asked = TypeVar("Asked")
# its READs posted
Pending = TypeVar("Pending")
Handle = str | Mapping[str, Any]


@dataclass(frozen=True)
class Stages(Generic[Asked, Pending]):
    """The client's halves of one fetch, in the order ``fetch_iter`` runs them."""

    ask: Callable[[Handle], Asked]
    post: Callable[[Asked], Pending]
    finish: Callable[[Pending], Sample]


class Checker:
    """The client's two helper threads, made on first use on the client's device.

    Each is one thread. Its checks run one at a time beside the READs; its asks likewise,
    in the order of the handles."""

    def __init__(self, name: str, device: torch.device) -> None:
        self._name = name
        self._device = device
        self._lock = threading.Lock()
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The checker thread's."""
        return self._pool("check")

    def asker(self) -> concurrent.futures.ThreadPoolExecutor:
        """The asker thread's."""
        return self._pool("ask")

    def _pool(self, what: str) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(what)
            if pool is None:
                pool = self._pools[what] = concurrent.futures.ThreadPoolExecutor(
                    1, f"{self._name}-{what}", initializer=on_device, initargs=(self._device,)
                )
            return pool

    def close(self) -> None:
        """End the threads once the work submitted is done (a later use makes others)."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)


def fetch_iter(
    stages: Stages[Asked, Pending],
    checker: Checker,
    handles: Iterable[Handle],
    in_flight: int | None,
) -> Iterator[Sample | FetchError]:
    """The samples of ``handles`` in their order, each a ``Sample`` or that one's ``FetchError``.

    Up to ``in_flight`` of them are READ ahead (None: all). Meanwhile ``checker``'s asker
    thread asks for the next one, and its checker thread finishes each. Left early, the
    samples READ ahead are finished and released, and their pages go back. The one asked
    for ahead stays held at its producer, as if never asked for: an answered ask does not
    change a hold."""

    if in_flight is not None and in_flight < 1:
        raise ConfigurationError(f"in_flight must be at least 1, got {in_flight}")
    executor, asker = checker.executor(), checker.asker()
    pending: collections.deque[concurrent.futures.Future[Sample] | FetchError] = collections.deque()
    asks: collections.deque[concurrent.futures.Future[Asked]] = collections.deque()
    todo = iter(handles)

    def ask_next() -> None:
        for h in todo:
            asks.append(asker.submit(stages.ask, h))
            return

    try:
        ask_next()
        while asks:
            asked = asks.popleft()
            # its round trip runs while this one's READs are posted
            ask_next()
            try:
                pending.append(executor.submit(stages.finish, stages.post(asked.result())))
            except FetchError as e:
                pending.append(e)
            if in_flight is not None and len(pending) >= in_flight:
                yield _outcome(pending.popleft())
        while pending:
            yield _outcome(pending.popleft())
    # left early: the ask under way ends first; the samples READ ahead give their pages back
    finally:
        concurrent.futures.wait(asks)
        for p in pending:
            got = _outcome(p)
            if isinstance(got, Sample):
                got.release()


def _outcome(outcome: concurrent.futures.Future[Sample] | FetchError) -> Sample | FetchError:
    if isinstance(outcome, FetchError):
        return outcome
    try:
        return outcome.result()
    except FetchError as e:
        return e
