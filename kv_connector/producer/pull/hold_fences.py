"""Hold fences: one 8-byte word per held sample, in a table registered beside the cache.

With it a consumer can tell, after its READ completed, that the hold was still live while
it read: the seqlock's second look. The rank registers the table with its NIXL agent.

A hold opens a slot and writes a value no hold of this process had before: a random base,
counting up, never 0. Its end writes 0 to the slot before the ledger lets its blocks go back
to vLLM. The consumer READs the word after its data READ completed, and compares it with
the value its ``PullShare`` named. Equal means the hold was live after the last byte
landed. So no later sample's writes, from vLLM reusing the blocks, can be in what it read.
Anything else fails the sample, by the name of how the hold ended.

A full table, with more holds at once than slots, opens no fence; such a sample is
released with an answer instead. Pure logic: the table is a numpy view of the registered
memory.
"""


from __future__ import annotations

import secrets

import numpy as np

from kv_connector.common.errors import ConfigurationError

# holds fenced at once (512 KiB registered)
FENCE_SLOTS = 1 << 16
WORD_BYTES = 8


class FenceTable:
    """``words``: the registered table as uint64 (one slot each)."""

    def __init__(self, words: np.ndarray, first_value: int | None = None) -> None:
        if words.dtype != np.uint64 or words.ndim != 1 or not len(words):
            raise ConfigurationError("a fence table is a non-empty 1-D uint64 array")
        self.words = words
        self.words[:] = 0
        # values count up from a random base: a restarted producer's never match an old share's
        self._next = first_value if first_value is not None else secrets.randbits(62) + 1
        self._free = list(range(len(words) - 1, -1, -1))

    @property
    def open_slots(self) -> int:
        return len(self.words) - len(self._free)

    def open(self) -> tuple[int, int] | None:
        """A slot and its value for a new hold, written now; None when the table is full."""
        if not self._free:
            return None
        slot, value = self._free.pop(), self._next
        self._next += 1
        self.words[slot] = value
        return slot, value

    def close(self, slot: int) -> None:
        """The hold of ``slot`` ended: its word is 0 from now on, and the slot free."""
        if self.words[slot] == 0:
            raise ConfigurationError(f"fence slot {slot} is not open")
        self.words[slot] = 0
        self._free.append(slot)


__all__ = ["FENCE_SLOTS", "WORD_BYTES", "FenceTable"]
