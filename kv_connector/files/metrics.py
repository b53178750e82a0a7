"""The file CLI's Prometheus metrics, beside the reader's on the same endpoint (``--metrics``):
made at scrape time from ``FileStats`` snapshots, named as the reader's are
(``hidden_states_reader_*``, the series a dashboard of the CLI reads together).
Imported when a metrics endpoint is made (prometheus_client is optional)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kv_connector.files.stats import FileStats
from kv_connector.reader.push.metrics import PREFIX, Spec, histogram_family

FILES = Spec(PREFIX + "files_written", "Sample files written, fsynced and renamed into place (CLI).")
FILE_BYTES = Spec(PREFIX + "file_bytes", "Bytes of the sample files written (CLI).")
FSYNC = Spec(PREFIX + "fsync_seconds", "Each fsync of a sample file or of its directory (CLI).")
ALL = (FILES, FILE_BYTES, FSYNC)


def file_families(files: FileStats) -> list[Metric]:
    """The CLI's files."""
    fsync: HistogramMetricFamily = histogram_family(FSYNC, files.fsync)
    return [
        CounterMetricFamily(FILES.name, FILES.doc, value=files.files),
        CounterMetricFamily(FILE_BYTES.name, FILE_BYTES.doc, value=files.bytes),
        fsync,
    ]


class FilesCollector(Collector):
    """Collects the CLI's file metrics at each scrape, from ``snapshot()``."""

    def __init__(self, snapshot: Callable[[], FileStats]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        return file_families(self._snapshot())


__all__ = ["ALL", "FilesCollector", "file_families"]
