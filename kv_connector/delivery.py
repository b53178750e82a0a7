"""Scheduler side: which readers the workers can reach, whether a new request may start,
and where each live request's sample stands.

Pure logic (no vllm, nixl or torch). The workers report, each step, changes of their link
to every reader and the requests that were delivered or failed (``DeliveryBook.update``).
From that:

* ``admit`` decides whether a new request starts now, waits (its reader is not reachable
  yet), or, after waiting ``connect_timeout_s``, starts without shipping and is failed:
  a waiting request holds no KV blocks, and a failed one reports why in its
  ``kv_transfer_params``;
* ``outcome`` says, when a request finishes, whether its sample was delivered, failed
  (and why), or is still on its way.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

NOT_REPORTED = "no worker has reported a connection yet"


class Router:
    """Picks each sample's reader on the scheduler side, so every rank agrees.

    "request_hash": crc32 of the request id modulo the readers (stable across restarts);
    "round_robin": in the order requests start, skipping readers no worker can reach. A
    full reader only delays its own samples and a gone one only fails its own: each
    reader has its own sender per rank.
    """

    def __init__(self, num_readers: int, policy: str = "request_hash") -> None:
        if num_readers <= 0:
            raise ValueError("at least one reader")
        if policy not in ("request_hash", "round_robin"):
            raise ValueError(f"unknown sharding policy {policy!r}")
        self.num_readers = num_readers
        self.policy = policy
        self._next = 0

    def route(self, request_id: str) -> int:
        """The reader of a request, whether or not it is reachable."""
        r = self.pick(request_id, lambda _: True)
        assert r is not None
        return r

    def pick(self, request_id: str, up: Callable[[int], bool]) -> int | None:
        """The reader of a request among those ``up``; None if its reader (request_hash)
        or every reader (round_robin) is down."""
        if self.policy == "request_hash" or self.num_readers == 1:
            r = zlib.crc32(request_id.encode()) % self.num_readers if self.num_readers > 1 else 0
            return r if up(r) else None
        for i in range(self.num_readers):
            r = (self._next + i) % self.num_readers
            if up(r):
                self._next = (r + 1) % self.num_readers
                return r
        return None


@dataclass(frozen=True)
class Admission:
    """``kind``: "run" (ship to ``reader``), "wait" (ask again next step) or "fail"
    (run without shipping; ``why`` goes into its kv_transfer_params)."""

    kind: str
    reader: int = 0
    why: str = ""


class DeliveryBook:
    def __init__(
        self,
        readers: Sequence[str],
        world_size: int,
        connect_timeout_s: float,
        router: Router | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if world_size <= 0:
            raise ValueError("world size must be positive")
        self.readers = list(readers)
        self.world_size = world_size
        self.connect_timeout_s = connect_timeout_s
        self.router = router or Router(len(self.readers))
        self._clock = clock
        self._links: dict[tuple[int, int], str | None] = {}  # (reader, rank) -> None: connected
        self._live: set[str] = set()
        self._admitted: dict[str, int] = {}  # request id -> its reader
        self._waiting_since: dict[str, float] = {}
        self._failed: dict[str, str] = {}
        self._delivered: set[str] = set()

    # ------------------------------------------------------------ worker reports
    def update(
        self,
        links: Iterable[tuple[int, int, str | None]],
        failures: Mapping[str, str],
        delivered: Iterable[str],
    ) -> list[tuple[str, str]]:
        """Take one step's reports; returns the failures of requests that already
        finished (their kv_transfer_params are gone: the caller logs them)."""
        for reader, rank, error in links:
            if 0 <= reader < len(self.readers) and 0 <= rank < self.world_size:
                self._links[(reader, rank)] = error
        late = []
        for rid, why in failures.items():
            if rid in self._live:
                self._failed.setdefault(rid, why)
            else:
                late.append((rid, why))
        self._delivered.update(rid for rid in delivered if rid in self._live)
        return late

    def is_up(self, reader: int) -> bool:
        """Every rank reported a working connection to this reader."""
        return all(self._links.get((reader, r), NOT_REPORTED) is None for r in range(self.world_size))

    def link_error(self, reader: int) -> str:
        for r in range(self.world_size):
            err = self._links.get((reader, r), NOT_REPORTED)
            if err is not None:
                return f"rank {r}: {err}" if self.world_size > 1 else err
        return ""

    # ---------------------------------------------------------- request life
    def add(self, request_id: str) -> None:
        self._live.add(request_id)

    def admit(self, request_id: str) -> Admission:
        """Called each step while a new request waits to start (and again if it is
        preempted and recomputed: an admitted request always runs)."""
        if request_id in self._admitted:
            return Admission("run", self._admitted[request_id])
        if request_id in self._failed:
            return Admission("fail", why=self._failed[request_id])
        now = self._clock()
        since = self._waiting_since.setdefault(request_id, now)
        reader = self.router.pick(request_id, self.is_up)
        if reader is not None:
            self._waiting_since.pop(request_id, None)
            if request_id in self._live:
                self._admitted[request_id] = reader
            return Admission("run", reader)
        if now - since < self.connect_timeout_s:
            return Admission("wait")
        self._waiting_since.pop(request_id, None)
        if self.router.policy == "request_hash" or len(self.readers) == 1:
            r = self.router.route(request_id)
            why = (
                f"cannot reach the reader at {self.readers[r]} for {self.connect_timeout_s:.0f} s "
                f"(last error: {self.link_error(r)})"
            )
        else:
            why = (
                f"cannot reach any reader ({', '.join(self.readers)}) for {self.connect_timeout_s:.0f} s "
                f"(last error: {self.link_error(0)})"
            )
        if request_id in self._live:
            self._failed[request_id] = why
        return Admission("fail", why=why)

    def fail(self, request_id: str, why: str) -> None:
        if request_id in self._live:
            self._failed.setdefault(request_id, why)

    def outcome(self, request_id: str) -> dict[str, str]:
        """Where the request's sample stands now: {"status": "delivered"}, {"status":
        "failed", "error": why} or {"status": "pending"} (still on its way; a later
        failure is logged by the scheduler with the request id)."""
        if request_id in self._failed:
            return {"status": "failed", "error": self._failed[request_id]}
        if request_id in self._delivered:
            return {"status": "delivered"}
        return {"status": "pending"}

    def finish(self, request_id: str) -> None:
        """The request finished: forget it (later reports about it are "late")."""
        self._live.discard(request_id)
        self._admitted.pop(request_id, None)
        self._waiting_since.pop(request_id, None)
        self._failed.pop(request_id, None)
        self._delivered.discard(request_id)

    def __len__(self) -> int:
        return len(self._live)
