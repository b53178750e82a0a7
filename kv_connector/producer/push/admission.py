"""Push's admission: a new request starts once every rank reaches the reader it is bound to.

Waiting for that gives its sample somewhere to go. Pure logic
: no vllm, nixl or torch. Each step the
workers report changes of their link to every reader (``ReaderAdmission.links``).
``admit`` then binds a request to a reader that is up (``Router``) and lets it wait while
none is. It fails the request after ``connect_timeout_s`` (``DeliveryBook.wait_or_fail``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence

from kv_connector.common.errors import ConfigurationError
from kv_connector.producer.delivery import Admission, DeliveryBook
from kv_connector.producer.options import Sharding
from kv_connector.producer.worker_report import LinkChange

NOT_REPORTED = "no worker has reported a connection yet"


class Router:
    """Picks each sample's reader on the scheduler side, so every rank agrees.

    "request_hash": crc32 of the request id modulo the readers, stable across restarts.
    "round_robin": in the order requests start, skipping readers no worker can reach. Each
    reader has its own sender per rank. So a full reader only delays its own samples, and a
    gone one only fails its own.
    """

    def __init__(self, readers: Sequence[str], policy: Sharding | str = Sharding.REQUEST_HASH) -> None:
        if not readers:
            raise ConfigurationError("at least one reader")
        try:
            self.policy = Sharding(policy)
        except ValueError:
            raise ConfigurationError(f"unknown sharding policy {policy!r}") from None
        self.readers = tuple(readers)
        self._next = 0

    @property
    def binds(self) -> bool:
        """Whether a request's reader is fixed before it runs: request_hash, or a single reader.

        Then a request that fails still names the reader it was bound for."""
        return self.policy is Sharding.REQUEST_HASH or len(self.readers) == 1

    def route(self, request_id: str) -> str:
        """The reader of a request, whether or not it is reachable."""
        r = self.pick(request_id, lambda _: True)
        assert r is not None
        return r

    def pick(self, request_id: str, up: Callable[[str], bool]) -> str | None:
        """The reader of a request among those ``up``; None if its reader (request_hash)
        or every reader (round_robin) is down."""
        n = len(self.readers)
        if self.binds:
            r = self.readers[zlib.crc32(request_id.encode()) % n if n > 1 else 0]
            return r if up(r) else None
        for i in range(n):
            k = (self._next + i) % n
            if up(self.readers[k]):
                self._next = (k + 1) % n
                return self.readers[k]
        return None


class ReaderAdmission:
    """Which readers every rank reaches, and the admission that follows from it.

    The links of every (reader, rank) are its own; a request's answer is the book's."""

    def __init__(self, book: DeliveryBook, readers: Sequence[str], world_size: int, router: Router) -> None:
        if world_size <= 0:
            raise ConfigurationError("world size must be positive")
        self.book = book
        self.readers = list(readers)
        self.world_size = world_size
        self.router = router
        # (reader, rank) -> None: connected
        self._links: dict[tuple[str, int], str | None] = {}

    def links(self, changes: Iterable[LinkChange | tuple[str, int, str | None]]) -> None:
        """Take one step's link changes (reports of unknown readers or ranks are ignored)."""
        for reader, rank, error in changes:
            if reader in self.readers and 0 <= rank < self.world_size:
                self._links[(reader, rank)] = error

    def is_up(self, reader: str) -> bool:
        """Every rank reported a working connection to this reader."""
        return all(self._links.get((reader, r), NOT_REPORTED) is None for r in range(self.world_size))

    def link_error(self, reader: str) -> str:
        for r in range(self.world_size):
            err = self._links.get((reader, r), NOT_REPORTED)
            if err is not None:
                return f"rank {r}: {err}" if self.world_size > 1 else err
        return ""

    def admit(self, request_id: str) -> Admission:
        """Called each step while a new request waits to start.

        It is called again if the request is preempted and recomputed: an admitted request
        always runs."""
        decided = self.book.decided(request_id)
        if decided is not None:
            return decided
        reader = self.router.pick(request_id, self.is_up)
        if reader is not None:
            return self.book.run(request_id, reader)
        return self.book.wait_or_fail(request_id, lambda: self._unreachable(request_id))

    def _unreachable(self, request_id: str) -> str:
        t = self.book.connect_timeout_s
        if self.router.binds:
            r = self.router.route(request_id)
            return f"cannot reach the reader at {r} for {t:.0f} s (last error: {self.link_error(r)})"
        return (
            f"cannot reach any reader ({', '.join(self.readers)}) for {t:.0f} s "
            f"(last error: {self.link_error(self.readers[0])})"
        )

    def started(self, request_id: str) -> str | None:
        """vLLM scheduled the request; one it ran without admitting is bound now.

        vLLM overrides the connector's "not yet" for requests that skip the prefix cache,
        such as those asking for ``prompt_logprobs``. Such a request is bound to a reader
        that is up, or else to the one it routes to, whose sender ships it once connected.
        Returns the reader it bound such a request to; None for any other."""
        rec = self.book.table.get(request_id)
        if rec is None or rec.admitted or rec.failed is not None:
            return None
        reader = self.router.pick(request_id, self.is_up) or self.router.route(request_id)
        self.book.run(request_id, reader)
        return reader

    def bound(self, request_id: str) -> str | None:
        """The reader a request that failed before it ran was bound for; its kv_transfer_params name it.

        Only a policy that binds one gives it; round robin binds none."""
        return self.router.route(request_id) if self.router.binds else None
