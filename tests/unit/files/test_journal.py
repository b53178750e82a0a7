"""The reader CLI's delivery journal: what is added is found after a restart; a torn or
zeroed last record (power loss mid-append) is cut off or skipped, never merged into the
next; ids cannot forge each other's records; one writer per directory; 10M records load
(how fast is measured by scripts/bench/journal.py, not here)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kv_connector.files import journal
from kv_connector.files.journal import HEADER, RECORD, Journal, JournalLocked


def test_added_keys_are_found_after_a_restart(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    assert ("p", "a") not in j and len(j) == 0
    j.add("p", "a")
    j.add("q", "a")
    assert ("p", "a") in j and ("q", "a") in j and ("p", "b") not in j
    j.close()
    j = Journal(tmp_path)
    assert ("p", "a") in j and ("q", "a") in j and ("p", "b") not in j and len(j) == 2
    assert (tmp_path / journal.NAME).stat().st_size == len(HEADER) + 2 * RECORD
    j.close()


@pytest.mark.parametrize(
    "key, forged",
    [
        (("p\tq", "r"), ("p", "q\tr")),
        (("p", "a\nq\tb"), ("q", "b")),
        (("ab", "c"), ("a", "bc")),
        (("", "x"), ("x", "")),
    ],
)
def test_ids_cannot_forge_another_key(tmp_path: Path, key: tuple[str, str], forged: tuple[str, str]) -> None:
    j = Journal(tmp_path)
    j.add(*key)
    j.close()
    j = Journal(tmp_path)
    assert key in j and forged not in j
    j.close()


def test_a_torn_last_record_is_cut_off_and_the_next_append_is_whole(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.add("p", "a")
    j.close()
    path = tmp_path / journal.NAME
    with open(path, "ab") as f:  # power lost 10 bytes into the next record
        f.write(journal.records(np.array([journal.key_hash("p", "b")], dtype=np.uint64))[:10])
    j = Journal(tmp_path)
    assert j.torn_bytes == 10 and ("p", "a") in j and ("p", "b") not in j
    j.add("p", "c")
    j.close()
    j = Journal(tmp_path)
    assert ("p", "a") in j and ("p", "c") in j and len(j) == 2 and j.torn_bytes == 0 and j.skipped == 0
    j.close()


def test_a_zeroed_or_damaged_record_is_skipped_not_believed(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    for rid in "abc":
        j.add("p", rid)
    j.close()
    path = tmp_path / journal.NAME
    with open(path, "r+b") as f:
        f.seek(len(HEADER) + RECORD + 3)  # a flipped bit in "b"'s record
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with open(path, "ab") as f:
        f.write(bytes(RECORD))  # the file system extended the file, the data never came
    j = Journal(tmp_path)
    assert j.skipped == 2 and len(j) == 2
    assert ("p", "a") in j and ("p", "b") not in j and ("p", "c") in j
    j.close()


def test_one_writer_per_directory(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    with pytest.raises(JournalLocked, match="in use"):
        Journal(tmp_path)
    j.close()
    Journal(tmp_path).close()


def test_a_file_that_is_not_a_journal_is_refused(tmp_path: Path) -> None:
    (tmp_path / journal.NAME).write_bytes(b"producer\trequest\n" * 3)
    with pytest.raises(ValueError, match="not a delivery journal"):
        Journal(tmp_path)


def test_ten_million_records_load_and_answer_exactly(tmp_path: Path) -> None:
    n = 10_000_000
    rng = np.random.default_rng(7)
    hashes = rng.integers(0, 2**64, size=(n, 2), dtype=np.uint64, endpoint=False)
    known = [(f"producer-{i % 3}", f"cmpl-{i}-0-abcd") for i in range(20)]
    for i, key in enumerate(known):
        hashes[(i * n) // len(known) + i] = journal.key_hash(*key)
    # a record with the same low half as a key's hash but another high half: only the
    # full 128 bits tell it from that key's own record
    lo, hi = journal.key_hash("producer-x", "absent")
    impostor = np.array([[lo, hi ^ 1]], dtype=np.uint64)
    with open(tmp_path / journal.NAME, "wb") as f:
        f.write(HEADER)
        f.write(journal.records(hashes))
        f.write(journal.records(impostor))
    del hashes
    j = Journal(tmp_path)
    assert len(j) == n + 1 and j.skipped == 0
    assert all(k in j for k in known)
    assert not any((p, f"{r}-x") in j for p, r in known)
    assert ("producer-x", "absent") not in j
    j.add("producer-0", "fresh")
    assert ("producer-0", "fresh") in j
    j.close()
