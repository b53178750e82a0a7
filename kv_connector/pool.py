"""The reader's receive pool accounting: pages, credits and a FIFO of waiting requests.

Pure logic. A credit is a granted page; a producer writes only into pages granted to it,
and a page returns to the pool only once its sample was copied out. Requests are served
in arrival order, so a large sample is not starved by a stream of small ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class PoolTooSmall(ValueError):
    """A sample needs more pages than the whole pool holds."""


class PagePool:
    """``num_pages`` pages; ``request`` queues a need, ``grantable`` hands out pages."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"a pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: dict[int, Hashable] = {}
        self._waiting: OrderedDict[Hashable, int] = OrderedDict()
        self._quarantined: list[tuple[float, Hashable, list[int]]] = []

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return len(self._owner)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def request(self, key: Hashable, n: int) -> None:
        """Queue a need for ``n`` pages under ``key`` (refused if it can never fit)."""
        if n <= 0:
            raise ValueError(f"a request needs at least one page, got {n}")
        if n > self.num_pages:
            raise PoolTooSmall(
                f"sample needs {n} pages, the pool holds {self.num_pages}; make the reader's pool larger"
            )
        if key in self._waiting:
            raise ValueError(f"{key!r} is already waiting for pages")
        self._waiting[key] = n

    def cancel(self, key: Hashable) -> bool:
        """Drop a waiting request; True if it was waiting."""
        return self._waiting.pop(key, None) is not None

    def grantable(self) -> list[tuple[Hashable, list[int]]]:
        """Grant pages to waiting requests in arrival order while the head fits."""
        out = []
        while self._waiting:
            key, n = next(iter(self._waiting.items()))
            if n > len(self._free):
                break
            del self._waiting[key]
            pages = [self._free.pop() for _ in range(n)]
            for p in pages:
                self._owner[p] = key
            out.append((key, pages))
        return out

    def release(self, key: Hashable, pages: list[int]) -> None:
        """Return ``pages`` held by ``key`` to the pool."""
        for p in pages:
            if self._owner.get(p) != key:
                raise ValueError(f"page {p} is not held by {key!r}")
        for p in pages:
            del self._owner[p]
            self._free.append(p)

    def quarantine(self, key: Hashable, pages: list[int], until: float) -> None:
        """``pages`` stay held by ``key`` until ``until``: a sample that can never be
        handed out keeps its pages a while, so a late WRITE into them lands unseen."""
        self._quarantined.append((until, key, pages))
        self._quarantined.sort(key=lambda q: q[0])

    def end_quarantines(self, now: float) -> bool:
        """Return the pages whose quarantine ended; True if any did."""
        ended = False
        while self._quarantined and self._quarantined[0][0] <= now:
            _, key, pages = self._quarantined.pop(0)
            self.release(key, pages)
            ended = True
        return ended
