"""The reader's progress on the terminal, and the CLI's file metrics (the I/O shell around
``reader.progress``): on a terminal one live line, redrawn twice a second (a log line
printed meanwhile clears it first); elsewhere a plain log line every ten seconds; a
summary at the end. Used by the reader CLI and ``scripts/demo.py``."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from kv_connector.files.progress import RATE_WINDOW_S, RateWindow, Reading
from kv_connector.files.stats import FileStats
from kv_connector.reader import HiddenStatesReader

log = logging.getLogger("kv_connector.reader")

LIVE_INTERVAL_S = 0.5
LOG_INTERVAL_S = 10.0


def reading_of(reader: HiddenStatesReader, files: FileStats | None = None) -> Reading:
    stats = reader.stats()
    return Reading(
        t=time.monotonic(),
        samples=stats.samples,
        tokens=stats.tokens,
        bytes=stats.bytes,
        pool=reader.pool_state(),
        producers=len(reader.producers_connected()),
        files=files.files if files is not None else 0,
    )


class _ClearLine(logging.Filter):
    """Before a log record reaches the terminal, the live line goes."""

    def __init__(self, printer: ProgressPrinter) -> None:
        super().__init__()
        self._printer = printer

    def filter(self, record: logging.LogRecord) -> bool:
        self._printer.clear()
        return True


class ProgressPrinter:
    """Prints ``RateWindow.line()`` of ``read()`` every ``interval_s``: live on a terminal
    (``tty``; by default whether ``stream`` is one), otherwise through ``emit`` (a log
    line by default)."""

    def __init__(
        self,
        read: Callable[[], Reading],
        stream: TextIO | None = None,
        tty: bool | None = None,
        interval_s: float | None = None,
        emit: Callable[[str], None] | None = None,
    ) -> None:
        self._read = read
        self._emit = emit if emit is not None else lambda line: log.info("%s", line)
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if tty is None else tty
        self.interval_s = interval_s or (LIVE_INTERVAL_S if self.live else LOG_INTERVAL_S)
        # a log line's rates cover the time since the line before it, not only its last seconds
        self.progress = RateWindow() if self.live else RateWindow(max(RATE_WINDOW_S, self.interval_s))
        self._lock = threading.Lock()
        self._shown = False
        self._stop = threading.Event()
        self._filter = _ClearLine(self)
        self._handlers: list[logging.Handler] = []
        self._thread = threading.Thread(target=self._run, name="hs-progress", daemon=True)

    def start(self) -> ProgressPrinter:
        self.tick()
        if self.live:
            for h in logging.getLogger().handlers:
                if getattr(h, "stream", None) is self.stream:
                    h.addFilter(self._filter)
                    self._handlers.append(h)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            # a reading that fails must not end the run
            except Exception:
                log.exception("progress line failed")

    def tick(self) -> None:
        self.progress.add(self._read())
        line = self.progress.line()
        if not self.live:
            if self.progress.last is not None and self.progress.last.samples:
                self._emit(line)
            return
        with self._lock:
            self.stream.write(f"\r{line}\x1b[K")
            self.stream.flush()
            self._shown = True

    def clear(self) -> None:
        with self._lock:
            if self._shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._shown = False

    def close(self) -> None:
        """Stop, after a last reading; the live line stays on the screen."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for h in self._handlers:
            h.removeFilter(self._filter)
        self.progress.add(self._read())
        if self.live:
            with self._lock:
                self.stream.write(f"\r{self.progress.line()}\x1b[K\n")
                self.stream.flush()
                self._shown = False


class FileLog:
    """The CLI's files for its metrics and summary (thread-safe): ``fsync`` times each
    fsync, ``written`` counts a file once it is in place."""

    def __init__(self) -> None:
        self._stats = FileStats()
        self._lock = threading.Lock()

    def fsync(self, fd: int) -> None:
        t0 = time.perf_counter()
        os.fsync(fd)
        dt = time.perf_counter() - t0
        with self._lock:
            self._stats.fsync.observe(dt)

    def written(self, path: Path) -> None:
        size = path.stat().st_size
        with self._lock:
            self._stats.files += 1
            self._stats.bytes += size

    def snapshot(self) -> FileStats:
        with self._lock:
            return self._stats.snapshot()


class RunMonitor:
    """What the reader CLI shows of a run: the live line (or log lines), the file metrics
    on the reader's metrics endpoint, the summary at the end."""

    def __init__(self, reader: HiddenStatesReader, stream: TextIO | None = None) -> None:
        self.reader = reader
        self.files = FileLog()
        if reader.metrics is not None:
            from kv_connector.files.metrics import FilesCollector

            reader.metrics.register(FilesCollector(self.files.snapshot))
        self.printer = ProgressPrinter(lambda: reading_of(reader, self.files.snapshot()), stream).start()

    @property
    def live(self) -> bool:
        return self.printer.live

    def close(self) -> str:
        """Stop the progress line; returns the summary (also logged)."""
        self.printer.close()
        text = self.printer.progress.summary(self.reader.stats(), self.files.snapshot())
        log.info("%s", text)
        return text
