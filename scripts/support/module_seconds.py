"""Each test module's seconds, from a run's junit XML, for the order in which ``make test``
hands modules to pytest-xdist's workers (``tests/conftest.py``): the longest first, so that
no long module starts last and leaves one worker running alone at the end.

    python -m scripts.support.module_seconds JUNIT.xml [JUNIT.xml ...] > tests/module_seconds.json

``make test`` writes the XML where ``JUNIT_DIR`` is set. The table only orders the run: a
stale or missing entry costs minutes, never a result (an unknown module goes last)."""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def module_seconds(paths: list[Path]) -> dict[str, float]:
    """Seconds by module path (``tests/e2e/test_pull.py``), the tests' times summed."""
    out: collections.defaultdict[str, float] = collections.defaultdict(float)
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            module = case.get("classname", "").replace(".", "/") + ".py"
            out[module] += float(case.get("time", "0"))
    return {m: round(s, 1) for m, s in sorted(out.items(), key=lambda kv: (-kv[1], kv[0]))}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    json.dump(module_seconds([Path(a) for a in argv]), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
