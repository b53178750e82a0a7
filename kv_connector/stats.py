"""Counters of the sender and the reader, as typed records: what scripts, logs and
metrics read (through ``HiddenStatesSender.stats()`` and ``HiddenStatesReader.stats()``,
which return snapshots). Pure logic."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class SenderStats:
    """One rank's sender, since it started (times in seconds, summed over requests).

    requests: acknowledged by the reader; bytes: landed by completed WRITEs (rewrites
    included); grant_wait_s: from submission to the grant; write_s: WRITEs in flight;
    ack_wait_s: from the last completed WRITE to the Ack; checksum_s: hashing shares;
    rewrites: shares written again after the reader's checksum failed; write_retries:
    WRITEs posted again after failing in NIXL; reconnects: connections made after a
    lost one.
    """

    requests: int = 0
    bytes: int = 0
    grant_wait_s: float = 0.0
    write_s: float = 0.0
    ack_wait_s: float = 0.0
    checksum_s: float = 0.0
    rewrites: int = 0
    write_retries: int = 0
    reconnects: int = 0

    def snapshot(self) -> SenderStats:
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ReaderStats:
    """The reader, since it started.

    samples / bytes: handed out; refused: connections and samples refused (protocol
    errors, pool too small, checksum); copy_s: copying samples out of the pool; verify_s:
    checking shares against their checksums; checksum_mismatches: shares that failed;
    resends_acked: resends of samples already delivered, acknowledged without a copy;
    values_check_s: checking samples' states for NaN/Inf and all-zero tokens (``check_values``).
    """

    samples: int = 0
    bytes: int = 0
    refused: int = 0
    copy_s: float = 0.0
    verify_s: float = 0.0
    checksum_mismatches: int = 0
    resends_acked: int = 0
    values_check_s: float = 0.0

    def snapshot(self) -> ReaderStats:
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
