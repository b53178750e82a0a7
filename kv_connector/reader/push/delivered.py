"""The samples a reader has delivered, remembered so a producer that resends one after a
reconnect is acked, never handed a second copy (R4), and the peers each still waits to
ack (manual mode: until the user acks it). Bounded: the oldest are forgotten first;
``already_delivered`` (e.g. the file CLI's journal) answers for those written before.
Pure logic (part of the reader's ledger)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from kv_connector.reader.push.producers import PeerId
from kv_connector.reader.push.records import Key


class Delivered:
    def __init__(self, memory: int, already_delivered: Callable[[str, str], bool] | None = None) -> None:
        self.memory = memory
        self._already_delivered = already_delivered
        # handed-out samples -> the peers still owed an Ack ([] once acked)
        self._owed: collections.OrderedDict[Key, list[PeerId]] = collections.OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._owed

    def __iter__(self) -> Iterator[Key]:
        return iter(self._owed)

    def __len__(self) -> int:
        return len(self._owed)

    def known(self, key: Key) -> bool:
        """Delivered before: remembered here, or (older) known to ``already_delivered``."""
        return key in self._owed or (self._already_delivered is not None and self._already_delivered(*key))

    def resent(self, key: Key, peer: PeerId) -> bool:
        """A resend of a delivered sample by ``peer``: True if its Ack is still awaited (it
        is owed one then, with the others); False: ack it now."""
        waiting = self._owed.get(key)
        if waiting:
            waiting.append(peer)
            return True
        return False

    def remember(self, key: Key, peers: list[PeerId]) -> None:
        """``key`` was handed out; ``peers`` are owed an Ack."""
        self._owed[key] = peers
        while len(self._owed) > self.memory:
            self._owed.popitem(last=False)

    def owed(self, key: Key) -> list[PeerId] | None:
        """The peers still owed an Ack for ``key`` (None: not remembered)."""
        return self._owed.get(key)

    def acked(self, key: Key) -> list[PeerId] | None:
        """The user acked ``key``: the peers owed an Ack, now settled (a resend is acked at
        once). None when it is not remembered."""
        waiting = self._owed.get(key)
        if waiting is not None:
            self._owed[key] = []
        return waiting

    def forget(self, key: Key) -> None:
        """Rejected before it was acked: a resend is delivered again."""
        del self._owed[key]
