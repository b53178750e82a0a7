"""``python -m scripts.bench.datapath``: the data-path arms alone, as ``make bench`` runs
them (needs an idle machine): progress on stderr, the result JSON as the last stdout line,
with the keys of ``make bench``'s "data path:" line."""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any


def _exit_on_term(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # the finally blocks close every arm's processes


def main() -> None:
    argparse.ArgumentParser(prog="python -m scripts.bench.datapath", description=__doc__).parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    signal.signal(signal.SIGTERM, _exit_on_term)
    from scripts.bench.datapath.run import main as run
    from scripts.bench.summary import flatten

    print(json.dumps(flatten(run())), flush=True)


if __name__ == "__main__":
    main()
