"""``python -m scripts.bench.pull [--loader | --read]``: the pull arms (all of them, or one
part), progress on stderr, the result JSON as the last stdout line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any


def _exit_on_term(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # the finally blocks stop every process started


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.pull", description=__doc__)
    one = ap.add_mutually_exclusive_group()
    one.add_argument("--loader", action="store_true", help="the DataLoader pairings only")
    one.add_argument("--read", action="store_true", help="the READ pairings only")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signal.signal(signal.SIGTERM, _exit_on_term)
    from scripts.bench.pull import run

    if args.loader or args.read:
        print(json.dumps(run.part("loader" if args.loader else "read")), flush=True)
        sys.exit(0)
    print(json.dumps(run.main()), flush=True)


if __name__ == "__main__":
    main()
