"""Scraping a real Prometheus endpoint in tests: the text parsed with prometheus_client's
own parser, and a bounded wait for exact values (counters move when the code they count
runs, and vLLM's only once per engine step: a test waits for them, never sleeps)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from kv_connector.datagen.httpclient import Server

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]


def parse(text: str) -> Samples:
    """(sample name, sorted labels) -> value of every sample in the text."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def scrape(server: Server) -> tuple[str, Samples]:
    text = server.get_text("/metrics")
    return text, parse(text)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels include ``labels`` (None: none)."""
    want = set(labels.items())
    hits = [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else None


def wait_for_values(
    server: Server,
    want: Sequence[tuple[str, Mapping[str, str], float]],
    timeout: float = 60.0,
    nudge: Callable[[], None] | None = None,
) -> tuple[str, Samples]:
    """Scrape until every ``(name, labels, value)`` of ``want`` holds exactly (calling
    ``nudge`` between scrapes, e.g. to make an engine step); fail after ``timeout`` s
    naming what differs."""
    end = time.monotonic() + timeout
    while True:
        text, samples = scrape(server)
        wrong = {
            (name, tuple(labels.items())): (value(samples, name, **labels), v)
            for name, labels, v in want
            if value(samples, name, **labels) != v
        }
        if not wrong:
            return text, samples
        if time.monotonic() > end:
            raise AssertionError(f"metrics never reached their values (got, wanted): {wrong}")
        if nudge is not None:
            nudge()
        time.sleep(0.2)


def excerpt(text: str, prefix: str) -> str:
    """The lines of the exposition about the series starting with ``prefix`` (no
    comments, creation times or empty histogram buckets), for logs and reports."""
    out = []
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if not line.startswith(prefix) or name.endswith("_created"):
            continue
        if not (name.endswith("_bucket") and line.endswith(" 0.0")):
            out.append(line)
    return "\n".join(out)
