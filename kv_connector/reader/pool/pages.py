"""The reader's receive pool accounting: pages, credits and a FIFO of waiting requests.

Pure logic. A credit is a granted page, and a producer writes only into pages granted to
it. A page returns to the pool only once its sample is done with: released by the user,
or, after it was discarded, once no WRITE into it can land (``push/page_fences.py``).
Each sample gets one contiguous run of pages, so it can be handed out as a view of the
pool without a copy. Requests are served in arrival order, so a large sample is not
starved by a stream of small ones. Runs are taken next-fit from where the last one ended.
So a pool whose samples come back in about the order they went out behaves as a ring and
does not fragment. A run that does not fit waits, even with as many pages free in
pieces: nothing is lost, the producer waits.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Hashable

from kv_connector.common.errors import ConfigurationError


class PoolTooSmall(ConfigurationError):
    """A sample needs more pages than the whole pool holds."""


class PagePool:
    """``num_pages`` pages; ``request`` queues a need, ``grantable`` hands out runs."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ConfigurationError(f"a pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # sorted (start, length)
        self._free: list[tuple[int, int]] = [(0, num_pages)]
        self._cursor = 0
        self._owner: dict[Hashable, range] = {}
        self._used = 0
        self._waiting: OrderedDict[Hashable, int] = OrderedDict()

    @property
    def free_pages(self) -> int:
        return self.num_pages - self._used

    @property
    def used_pages(self) -> int:
        return self._used

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def request(self, key: Hashable, count: int) -> None:
        """Queue a need for ``count`` contiguous pages under ``key`` (refused if it can never fit)."""
        if count <= 0:
            raise ConfigurationError(f"a request needs at least one page, got {count}")
        if count > self.num_pages:
            raise PoolTooSmall(
                f"sample needs {count} pages, the pool holds {self.num_pages}; make the reader's pool larger"
            )
        if key in self._waiting or key in self._owner:
            raise ConfigurationError(f"{key!r} is already waiting for or holding pages")
        self._waiting[key] = count

    def cancel(self, key: Hashable) -> bool:
        """Drop a waiting request; True if it was waiting."""
        return self._waiting.pop(key, None) is not None

    def grantable(self) -> list[tuple[Hashable, range]]:
        """Grant runs to waiting requests in arrival order while the head fits."""
        out = []
        while self._waiting:
            key, n = next(iter(self._waiting.items()))
            run = self._take(n)
            if run is None:
                break
            del self._waiting[key]
            self._owner[key] = run
            out.append((key, run))
        return out

    def take_now(self, key: Hashable, count: int) -> range | None:
        """A run of ``count`` pages for ``key`` at once, or None: only when no request waits
        (those come first, R7) and a run fits now; nothing is queued."""
        if count <= 0:
            raise ConfigurationError(f"a run needs at least one page, got {count}")
        if self._waiting or key in self._owner:
            return None
        run = self._take(count)
        if run is not None:
            self._owner[key] = run
        return run

    def shrink(self, key: Hashable, count: int) -> range:
        """``key`` keeps the first ``count`` pages of its run; the rest go back. Returns what it keeps."""
        pages = self._owner.get(key)
        if pages is None or not 0 < count <= len(pages):
            raise ConfigurationError(f"{key!r} holds no run of at least {count} pages")
        kept, rest = range(pages.start, pages.start + count), range(pages.start + count, pages.stop)
        if rest:
            self._owner[key] = rest
            self.release(key, rest)
        self._owner[key] = kept
        return kept

    def _take(self, count: int) -> range | None:
        """Next fit: the first free run that holds ``count`` pages at or after the cursor,
        else from the start."""
        order = sorted(
            range(len(self._free)), key=lambda i: (self._free[i][0] < self._cursor, self._free[i][0])
        )
        for i in order:
            start, length = self._free[i]
            if length >= count:
                if length == count:
                    del self._free[i]
                else:
                    self._free[i] = (start + count, length - count)
                self._used += count
                self._cursor = (start + count) % self.num_pages
                return range(start, start + count)
        return None

    def release(self, key: Hashable, pages: range) -> None:
        """Return the run ``pages`` held by ``key`` to the pool."""
        if self._owner.get(key) != pages:
            raise ConfigurationError(f"pages {pages} are not held by {key!r}")
        del self._owner[key]
        self._used -= len(pages)
        i = bisect.bisect(self._free, (pages.start, 0))
        start, length = pages.start, len(pages)
        # merge the next run
        if i < len(self._free) and self._free[i][0] == start + length:
            length += self._free[i][1]
            del self._free[i]
        # and the previous
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            start, length = self._free[i - 1][0], self._free[i - 1][1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (start, length))

    def hand_over(self, key: Hashable, to: Hashable) -> None:
        """The run held by ``key`` is held by ``to`` from now on.

        A dropped sample's pages wait for their fence under the grant's name, since its key
        may come again."""
        if to in self._owner or to in self._waiting:
            raise ConfigurationError(f"{to!r} is already waiting for or holding pages")
        self._owner[to] = self._owner.pop(key)
