"""Every metric the producer and the reader serve is documented in docs/usage.md, with
its labels' values."""

from __future__ import annotations

from pathlib import Path

from kv_connector.files import metrics as files_metrics
from kv_connector.producer.step_stats import COUNTERS, FAILED, GAUGES, HISTOGRAMS
from kv_connector.reader.push import metrics as reader_metrics
from kv_connector.wire.failure import FailureReason

REPO = Path(__file__).resolve().parents[2]


def test_every_metric_is_documented() -> None:
    usage = (REPO / "docs" / "usage.md").read_text()
    names = [m.name for m in (*COUNTERS.values(), FAILED, *HISTOGRAMS.values(), *GAUGES.values())]
    names += [m.name for m in (*reader_metrics.ALL, *files_metrics.ALL)]
    assert [n for n in names if n not in usage] == []
    quoted = set(usage.split("`"))
    assert {r.value for r in FailureReason} <= quoted
    assert {r.value for r in reader_metrics.RefusalReason} <= quoted
    assert {s.value for s in reader_metrics.PageState} <= quoted
