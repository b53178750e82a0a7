"""The reader's progress line and the summary of a run (``kv_connector.files.progress``)."""

from __future__ import annotations

import pytest

from kv_connector.files.progress import RateWindow, Reading, duration, pool_use, si
from kv_connector.files.stats import FileStats
from kv_connector.reader.push.stats import PoolState, ReaderStats


def reading(t: float, samples: int, free: int = 10, waiting: int = 0, producers: int = 1) -> Reading:
    pool = PoolState(64, 10, free, 10 - free, 0, 0, waiting)
    return Reading(
        t, samples, tokens=samples * 1000, bytes=samples * 2_000_000, pool=pool, producers=producers
    )


def test_the_progress_line_shows_rates_over_its_window() -> None:
    p = RateWindow(window_s=5.0)
    assert p.line() == "waiting for producers"
    p.add(reading(0.0, 0))
    assert p.line() == "0 samples | pool 0% | 1 producer"  # one reading: no rate to speak of
    p.add(reading(1.0, 100, free=6, waiting=2, producers=2))
    assert p.line() == "100 samples | 100.0k tok/s | 0.20 GB/s | pool 40% (2 waiting) | 2 producers"
    for t in range(2, 12):
        p.add(reading(float(t), 100 + 10 * (t - 1)))  # slower: 10 samples/s
    assert p.rates() == pytest.approx((10.0, 10_000.0, 20_000_000.0))  # the window forgot the burst
    assert p.peak_pool_use == pytest.approx(0.4)


def test_the_summary_says_the_whole_run() -> None:
    p = RateWindow()
    p.add(reading(0.0, 0))
    p.add(reading(30.0, 50, free=2))  # the reader waited 20 s for its first producer
    st = ReaderStats(samples=50, tokens=50_000, bytes=100_000_000, checksum_mismatches=1, dropped=1)
    st.first_request_t, st.last_handout_t = 120.0, 130.0  # the reader's own clock
    st.peak_pages_used = 9  # between two readings the pool was fuller: 9 of 10 pages
    files = FileStats(files=50, bytes=101_000_000)
    files.fsync.observe(0.25)
    text = p.summary(st, files)
    assert text == (
        "received 50 samples, 50,000 tokens, 0.100 GB in 10.0 s (5.0k tok/s, 0.01 GB/s); "
        "pool at most 90% used; 1 checksum failures, 0 samples refused, 1 dropped; "
        "50 files written (0.101 GB), fsync 0.2 s in all"
    )
    assert "0 samples, 0 tokens, 0.000 GB in 0.0 s (0 tok/s" in RateWindow().summary(ReaderStats())


def test_numbers_for_people() -> None:
    assert (si(999), si(1234), si(2_500_000), si(3e9)) == ("999", "1.2k", "2.5M", "3.0G")
    assert (duration(5.04), duration(75), duration(3725)) == ("5.0 s", "1m15s", "1h02m05s")
    assert pool_use(PoolState()) is None and pool_use(PoolState(64, 4, 1)) == 0.75


def test_the_live_line_is_cleared_for_a_log_record_and_stays_at_the_end() -> None:
    import io
    import logging

    from kv_connector.files.console import ProgressPrinter

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    readings = iter([reading(0.0, 0), reading(1.0, 10)])  # at start, at close
    try:
        printer = ProgressPrinter(lambda: next(readings), stream=out, tty=True, interval_s=3600).start()
        logging.getLogger("kv_connector.test").warning("something happened")
        printer.close()
        logging.getLogger("kv_connector.test").warning("after")  # the filter is gone
    finally:
        root.removeHandler(handler)
    first = "0 samples | pool 0% | 1 producer"
    last = "10 samples | 10.0k tok/s | 0.02 GB/s | pool 0% | 1 producer"
    assert out.getvalue() == f"\r{first}\x1b[K\r\x1b[Ksomething happened\n\r{last}\x1b[K\nafter\n"


def test_off_a_terminal_progress_goes_out_as_plain_lines() -> None:
    import io

    from kv_connector.files.console import ProgressPrinter

    lines: list[str] = []
    readings = iter([reading(0.0, 0), reading(1.0, 10), reading(2.0, 20)])
    printer = ProgressPrinter(
        lambda: next(readings), stream=io.StringIO(), interval_s=3600, emit=lines.append
    )
    assert not printer.live
    printer.start()  # no line before the first sample
    printer.tick()
    printer.close()  # a last reading, for the summary; no line
    assert lines == ["10 samples | 10.0k tok/s | 0.02 GB/s | pool 0% | 1 producer"]
    assert printer.progress.last is not None and printer.progress.last.samples == 20


def test_a_log_lines_rates_cover_the_time_since_the_line_before() -> None:
    """Off a terminal a line comes every ``interval_s`` (10 s): its rates are over that whole
    interval, not its last 5 s (which read 0.00 GB/s whenever samples came in bursts)."""
    import io

    from kv_connector.files.console import ProgressPrinter

    lines: list[str] = []
    readings = iter([reading(0.0, 0), reading(3.0, 30), reading(10.0, 30), reading(20.0, 30)])
    printer = ProgressPrinter(lambda: next(readings), stream=io.StringIO(), interval_s=10, emit=lines.append)
    printer.tick()
    printer.tick()  # t=3: 30 samples in 3 s
    printer.tick()  # t=10: none since t=3, but 30 in the 10 s since the first reading
    assert lines[-1] == "30 samples | 3.0k tok/s | 0.01 GB/s | pool 0% | 1 producer"
    printer.tick()  # t=20: none in the last 10 s: idle, and it says so
    assert lines[-1] == "30 samples | 0 tok/s | 0.00 GB/s | pool 0% | 1 producer"
