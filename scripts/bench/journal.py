"""The reader CLI's delivery journal at scale: how long a reader takes to start with N
samples already written (open and check the journal), and a lookup's cost, hit and miss.

    python -m scripts.bench.journal [--entries 10000000] [--dir DIR]

Prints one JSON line. The journal is built in bulk (``journal.records``) with the
hashes of real keys for a few samples and random hashes for the rest, then opened the
way the CLI opens it, from the page cache (the second of two opens) and after dropping
the file's pages where the kernel allows it (``posix_fadvise``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from kv_connector.files import journal


def build(out: Path, entries: int, known: list[tuple[str, str]]) -> None:
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**64, size=(entries, 2), dtype=np.uint64, endpoint=False)
    for i, key in enumerate(known):
        hashes[(i * entries) // len(known)] = journal.key_hash(*key)
    with open(out / journal.NAME, "wb") as f:
        f.write(journal.HEADER)
        step = 1 << 22
        for i in range(0, entries, step):
            f.write(journal.records(hashes[i : i + step]))


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--entries", type=int, default=10_000_000)
    ap.add_argument("--dir", default=None, help="where to build the journal (a temporary directory)")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="hs-journal-", dir=args.dir))
    try:
        known = [(f"vllm-producer-{i % 3}", f"cmpl-{i:032x}-0-{i:08x}") for i in range(64)]
        t0 = time.perf_counter()
        build(out, args.entries, known)
        build_s = time.perf_counter() - t0
        drop_cache(out / journal.NAME)
        t0 = time.perf_counter()
        j = journal.Journal(out)
        cold_s = time.perf_counter() - t0
        j.close()
        t0 = time.perf_counter()
        j = journal.Journal(out)
        open_s = time.perf_counter() - t0
        assert len(j) == args.entries and j.skipped == 0
        t0 = time.perf_counter()
        assert all(k in j for k in known)
        hit_s = (time.perf_counter() - t0) / len(known)
        misses = [("vllm-producer-0", f"cmpl-miss-{i}") for i in range(1000)]
        t0 = time.perf_counter()
        assert not any(k in j for k in misses)
        miss_s = (time.perf_counter() - t0) / len(misses)
        t0 = time.perf_counter()
        for i in range(100):
            j.add("vllm-producer-0", f"cmpl-new-{i}")
        add_s = (time.perf_counter() - t0) / 100
        j.close()
        print(
            json.dumps(
                {
                    "entries": args.entries,
                    "file_mib": round((out / journal.NAME).stat().st_size / (1 << 20), 1),
                    "open_s": round(open_s, 3),
                    "open_cold_s": round(cold_s, 3),
                    "lookup_hit_ms": round(hit_s * 1e3, 3),
                    "lookup_miss_us": round(miss_s * 1e6, 2),
                    "add_fdatasync_ms": round(add_s * 1e3, 3),
                    "build_s": round(build_s, 1),
                    "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                }
            )
        )
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
