"""The file CLI's own counters, as a typed record: the files it wrote and their fsyncs
(``console.FileWriter.snapshot()``, read by the progress line and the metrics). Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_connector.common.observe import OPERATION_BUCKETS_S, Histogram


@dataclass
class FileStats:
    """The reader CLI's files: written (whole, renamed into place) and their bytes; the
    fsyncs of files and of their directory."""

    files: int = 0
    bytes: int = 0
    fsync: Histogram = field(default_factory=lambda: Histogram(OPERATION_BUCKETS_S))

    def snapshot(self) -> FileStats:
        return FileStats(self.files, self.bytes, self.fsync.snapshot())


__all__ = ["FileStats"]
