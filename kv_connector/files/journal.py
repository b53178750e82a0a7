"""The reader CLI's exactly-once record: an append-only journal of the samples it wrote.

One file, ``OUT/.delivered``: a 16-byte header, then fixed-size 24-byte records, each the
128-bit BLAKE2b hash of a sample's key (producer id and request id, length-prefixed, so
no id can forge another's key) and a 64-bit check word mixed from it. A record is
appended and fdatasynced before the producer is acknowledged, so only the last record
can be torn by a crash or power loss: a partial record is cut off at start-up (the file
is truncated to whole records), and a record whose check word does not match (zeros the
file system left behind, bit rot) is skipped and counted.

Start-up reads the file once (memory-mapped), checks every record with a few vectorized
numpy passes and sorts one 64-bit word per record: the top bits of its hash's low half
with the record's index in the bottom bits (as many as the record count needs), so that
one sort (numpy's SIMD sort) orders the hashes and still says where each record is. 10M
records open in about half a second and take 8 bytes each besides the mapped file
(``scripts/bench/journal.py``). A lookup is a binary search for the hash's top bits and
a comparison of the full 128 bits of the few records found. An exclusive ``flock`` keeps
a second reader from writing into the same directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kv_connector.common.errors import ConfigurationError, StateError

log = logging.getLogger(__name__)

NAME = ".delivered"
# 16 bytes
HEADER = b"kv-hs-journal-1\n"
# bytes: hash low 64 bits, hash high 64 bits, check word (little-endian u64s)
RECORD = 24
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xC2B2AE3D27D4EB4F)
# a zero record does not check
_K3 = np.uint64(0x165667B19E3779F9)
# records checked at once (bounds the temporaries)
_CHUNK = 1 << 20

U64 = npt.NDArray[np.uint64]


class JournalLocked(StateError):
    """Another process holds the journal: two readers must not write into one directory."""


def key_hash(producer_id: str, request_id: str) -> tuple[int, int]:
    """The two 64-bit halves of the key's 128-bit hash."""
    p, r = producer_id.encode("utf-8", "surrogatepass"), request_id.encode("utf-8", "surrogatepass")
    d = hashlib.blake2b(
        len(p).to_bytes(4, "little") + p + r, digest_size=16, person=b"kv-hs-delivered"
    ).digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def check_words(lo: U64, hi: U64) -> U64:
    """The check word of each record's hash halves (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        out: U64 = (lo * _K1) ^ (hi * _K2) ^ _K3
    return out


def records(hashes: U64) -> bytes:
    """The journal records of ``hashes`` [n, 2] (low, high halves): what ``add`` writes,
    in bulk (for tests and benchmarks)."""
    h = np.ascontiguousarray(hashes, dtype="<u8").reshape(-1, 2)
    out = np.empty((h.shape[0], 3), dtype="<u8")
    out[:, :2] = h
    out[:, 2] = check_words(h[:, 0], h[:, 1])
    return out.tobytes()


class Journal:
    """``key in journal`` (a ``(producer_id, request_id)`` pair), ``add(producer_id,
    request_id)`` (durable when it returns); ``close`` releases the file and its lock."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / NAME
        new = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise JournalLocked(f"{self.path} is in use by another reader") from None
            # records that did not check
            self.skipped = 0
            # a partial last record, cut off
            self.torn_bytes = 0
            size = os.fstat(self._fd).st_size
            if new or size == 0:
                os.write(self._fd, HEADER)
                os.fsync(self._fd)
                _fsync_dir(out_dir)
                size = len(HEADER)
            self._load(size)
        except BaseException:
            os.close(self._fd)
            raise
        self._added: set[tuple[int, int]] = set()

    def _load(self, size: int) -> None:
        with open(self.path, "rb") as f:
            head = f.read(len(HEADER))
        if head != HEADER:
            raise ConfigurationError(f"{self.path} is not a delivery journal (header {head[:16]!r})")
        n, self.torn_bytes = divmod(size - len(HEADER), RECORD)
        if self.torn_bytes:
            log.warning("%s: a torn last record (%d bytes) cut off", self.path, self.torn_bytes)
            os.ftruncate(self._fd, len(HEADER) + n * RECORD)
            os.fsync(self._fd)
        self._recs: U64 = np.zeros((0, 3), dtype="<u8")
        self._index: U64 = np.zeros(0, dtype=np.uint64)
        self._bits = 1
        if n == 0:
            return
        recs = np.memmap(self.path, dtype="<u8", mode="r", offset=len(HEADER), shape=(n, 3))
        self._bits = max(1, n.bit_length())
        mask = np.uint64((1 << self._bits) - 1)
        index = np.empty(n, dtype=np.uint64)
        keep = np.empty(n, dtype=bool)
        for i in range(0, n, _CHUNK):
            part = recs[i : i + _CHUNK]
            keep[i : i + _CHUNK] = check_words(part[:, 0], part[:, 1]) == part[:, 2]
            index[i : i + _CHUNK] = (part[:, 0] & ~mask) | np.arange(i, i + len(part), dtype=np.uint64)
        self.skipped = int(n - np.count_nonzero(keep))
        if self.skipped:
            log.warning("%s: %d records that do not check skipped", self.path, self.skipped)
            index = index[keep]
        index.sort()
        self._recs, self._index = recs, index

    def __len__(self) -> int:
        return len(self._index) + len(self._added)

    def __contains__(self, key: tuple[str, str]) -> bool:
        lo, hi = key_hash(*key)
        if (lo, hi) in self._added:
            return True
        mask = (1 << self._bits) - 1
        top = lo & ~mask & 0xFFFF_FFFF_FFFF_FFFF
        i = int(np.searchsorted(self._index, np.uint64(top)))
        while i < len(self._index) and int(self._index[i]) & ~mask == top:
            rec = self._recs[int(self._index[i]) & mask]
            if int(rec[0]) == lo and int(rec[1]) == hi:
                return True
            i += 1
        return False

    def add(self, producer_id: str, request_id: str) -> None:
        """Append the sample's record and make it durable (raises ``OSError``, e.g. a full
        disk: then nothing may be acknowledged)."""
        lo, hi = key_hash(producer_id, request_id)
        rec = records(np.array([[lo, hi]], dtype=np.uint64))
        if os.write(self._fd, rec) != len(rec):
            raise OSError(f"short write to {self.path}")
        os.fdatasync(self._fd)
        self._added.add((lo, hi))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
