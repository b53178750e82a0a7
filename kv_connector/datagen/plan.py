"""The data-generation driver's bookkeeping: which row goes next, what came back, what is
retried and what was given up, and the progress figures. Pure logic (standard library
only; times are passed in).

A row goes through the states of ``row_states.py``, which draws them and holds the one
table of their legal transitions; ``RowBook`` moves a row only through it (``_move``). A
request that failed or got no answer is sent again after a backoff, or given up after
``max_attempts`` attempts in all.

Invariants: a row is in exactly one state; at most one request per row is in flight; a
row counts as delivered once; every row ends DELIVERED or GAVE_UP with its last reason.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kv_connector.common.errors import ConfigurationError
from kv_connector.datagen.row_states import ROWS, IllegalRowTransition, RowEvent, RowState
from kv_connector.wire.outcome import SampleStatus

__all__ = ["Counts", "IllegalRowTransition", "Row", "RowBook", "RowState"]

@dataclass
class Row:
    index: int
    tokens: int
    state: RowState = RowState.QUEUED
    attempts: int = 0
    retry_at: float = 0.0
    # when it entered its state
    since: float = 0.0
    error: str = ""
    # its file was seen (not only a "pending" answer)
    confirmed: bool = False


@dataclass(frozen=True)
class Counts:
    rows: int
    delivered: int
    # delivered on a "pending" answer alone (no directory to look in)
    unconfirmed: int
    gave_up: int
    in_flight: int
    awaiting: int
    retries: int
    tokens_delivered: int


@dataclass
class RowBook:
    """Every row from its first request to DELIVERED or GAVE_UP.

    ``confirm``: a "pending" answer waits for the row's file (``file_seen``) before it
    counts; without it, "pending" counts as delivered (unconfirmed). ``max_attempts``:
    requests per row in all. ``backoff_s``: the wait before a retry, doubled per attempt
    up to ``max_backoff_s``. ``confirm_timeout_s``: how long a pending row may wait for
    its file before it is sent again.
    """

    # row index -> its token count
    rows: dict[int, int]
    confirm: bool = False
    max_attempts: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    confirm_timeout_s: float = 120.0
    _rows: dict[int, Row] = field(init=False)
    _queue: deque[int] = field(init=False)
    retries: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")
        self._rows = {i: Row(i, n) for i, n in self.rows.items()}
        self._queue = deque(self.rows)

    # ------------------------------------------------------------ transitions
    def take(self, now: float) -> int | None:
        """The next row whose request may go out now (QUEUED -> SENT), or None."""
        for _ in range(len(self._queue)):
            i = self._queue.popleft()
            row = self._rows[i]
            if row.retry_at <= now:
                self._move(row, RowEvent.TAKEN, now)
                row.attempts += 1
                return i
            # not due yet: keep its place behind the others
            self._queue.append(i)
        return None

    def answered(self, index: int, status: SampleStatus, error: str, now: float) -> None:
        """The server answered the row's request with ``status`` (``error`` for failed)."""
        row = self._expect(index, RowState.SENT)
        if status is SampleStatus.DELIVERED:
            self._deliver(row, RowEvent.DELIVERED, now)
        elif status is SampleStatus.PENDING:
            if self.confirm:
                self._move(row, RowEvent.PENDING, now)
            else:
                self._deliver(row, RowEvent.UNCONFIRMED, now)
        else:
            self._retry(row, RowEvent.FAILED, error or "failed", now)

    def not_answered(self, index: int, error: str, now: float, retry: bool = True) -> None:
        """The request got no usable answer (connection, HTTP error, bad response);
        ``retry=False`` gives the row up at once (a request the server will always refuse)."""
        row = self._expect(index, RowState.SENT)
        if retry:
            self._retry(row, RowEvent.FAILED, error, now)
        else:
            self._give_up(row, RowEvent.GIVEN_UP, error, now)

    def file_seen(self, index: int, now: float) -> None:
        """The file of a row AWAITING it is there (written since its request went out)."""
        self._deliver(self._expect(index, RowState.AWAITING), RowEvent.FILE_SEEN, now)

    def audit_failed(self, index: int, why: str, now: float) -> None:
        """A delivered row's states failed the logprob audit: given up, not sent again (a
        wrong capture is wrong again)."""
        self._give_up(self._expect(index, RowState.DELIVERED), RowEvent.AUDIT_FAILED, why, now)

    def expire(self, now: float) -> list[int]:
        """Rows that waited ``confirm_timeout_s`` for their file: sent again (or given
        up). Returns them."""
        late = [
            r.index
            for r in self._rows.values()
            if r.state is RowState.AWAITING and now - r.since >= self.confirm_timeout_s
        ]
        for i in late:
            why = f"its file did not appear within {self.confirm_timeout_s:.0f} s"
            self._retry(self._rows[i], RowEvent.NO_FILE, why, now)
        return late

    # ---------------------------------------------------------------- queries
    def state(self, index: int) -> RowState:
        return self._rows[index].state

    def last_error(self, index: int) -> str:
        """Why the row's last request did not count ("" if none failed)."""
        return self._rows[index].error

    def awaiting(self) -> list[int]:
        return [r.index for r in self._rows.values() if r.state is RowState.AWAITING]

    def next_due(self) -> float | None:
        """When the earliest queued row may go out (None: nothing queued)."""
        return min((self._rows[i].retry_at for i in self._queue), default=None)

    @property
    def done(self) -> bool:
        return all(r.state in (RowState.DELIVERED, RowState.GAVE_UP) for r in self._rows.values())

    def given_up(self) -> dict[int, str]:
        """Rows given up, with their last reason."""
        return {r.index: r.error for r in self._rows.values() if r.state is RowState.GAVE_UP}

    def counts(self) -> Counts:
        by = {s: 0 for s in RowState}
        unconfirmed = tokens = 0
        for r in self._rows.values():
            by[r.state] += 1
            if r.state is RowState.DELIVERED:
                tokens += r.tokens
                unconfirmed += not r.confirmed
        return Counts(
            rows=len(self._rows),
            delivered=by[RowState.DELIVERED],
            unconfirmed=unconfirmed,
            gave_up=by[RowState.GAVE_UP],
            in_flight=by[RowState.SENT],
            awaiting=by[RowState.AWAITING],
            retries=self.retries,
            tokens_delivered=tokens,
        )

    # ---------------------------------------------------------------- helpers
    def _expect(self, index: int, state: RowState) -> Row:
        row = self._rows.get(index)
        if row is None or row.state is not state:
            got = row.state.value if row is not None else "unknown"
            raise IllegalRowTransition(f"row {index} is {got}, not {state.value}")
        return row

    def _move(self, row: Row, event: RowEvent, now: float) -> None:
        """The one mover: to where ``event`` leads (``row_states.ROWS``), or
        ``IllegalRowTransition`` with nothing changed."""
        row.state, row.since = ROWS.step(row.state, event, f"row {row.index}"), now

    def _deliver(self, row: Row, event: RowEvent, now: float) -> None:
        """Delivered: confirmed unless it counted on a "pending" answer alone."""
        self._move(row, event, now)
        row.confirmed, row.error = event is not RowEvent.UNCONFIRMED, ""

    def _retry(self, row: Row, event: RowEvent, error: str, now: float) -> None:
        if row.attempts >= self.max_attempts:
            self._give_up(row, RowEvent.GIVEN_UP, error, now)
            return
        self._move(row, event, now)
        self.retries += 1
        row.error = error
        row.retry_at = now + min(self.max_backoff_s, self.backoff_s * 2 ** (row.attempts - 1))
        self._queue.append(row.index)

    def _give_up(self, row: Row, event: RowEvent, error: str, now: float) -> None:
        self._move(row, event, now)
        row.error = error


# ------------------------------------------------------------------ progress
@dataclass(frozen=True)
class RunProgress:
    """Figures of a run so far: ``rows_done`` of ``rows`` (delivered or given up),
    throughput since the start, and the time left at that pace (None: not known yet)."""

    rows: int
    rows_done: int
    tokens: int
    tokens_done: int
    elapsed_s: float
    rows_per_s: float
    tokens_per_s: float
    eta_s: float | None

    @property
    def fraction(self) -> float:
        return self.rows_done / self.rows if self.rows else 1.0


def progress(rows: int, rows_done: int, tokens: int, tokens_done: int, elapsed_s: float) -> RunProgress:
    """The run's figures; the time left is estimated from the tokens still to send at the
    tokens/s so far (rows differ in length), or from rows when no token is done yet."""
    rate_r = rows_done / elapsed_s if elapsed_s > 0 else 0.0
    rate_t = tokens_done / elapsed_s if elapsed_s > 0 else 0.0
    eta: float | None
    if rows_done >= rows:
        eta = 0.0
    elif rate_t > 0 and tokens > 0:
        eta = max(0, tokens - tokens_done) / rate_t
    elif rate_r > 0:
        eta = (rows - rows_done) / rate_r
    else:
        eta = None
    return RunProgress(rows, rows_done, tokens, tokens_done, elapsed_s, rate_r, rate_t, eta)


def duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``, ``42s``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def rate(value: float) -> str:
    """``950``, ``12.3k``, ``4.56M``."""
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def line(progress: RunProgress, retries: int, gave_up: int) -> str:
    """One plain progress line (for logs and pipes)."""
    return (
        f"{progress.rows_done}/{progress.rows} rows ({100 * progress.fraction:.1f}%), "
        f"{progress.rows_per_s:.1f} rows/s, {rate(progress.tokens_per_s)} tokens/s, "
        f"ETA {duration(progress.eta_s)}, {retries} retried, {gave_up} failed"
    )


def bar(progress: RunProgress, retries: int, gave_up: int, width: int = 30) -> str:
    """A progress bar line for a terminal."""
    filled = min(width, int(progress.fraction * width))
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {progress.rows_done}/{progress.rows} rows "
        f"{rate(progress.tokens_per_s)} tok/s ETA {duration(progress.eta_s)}"
        + (f" ({retries} retried, {gave_up} failed)" if retries or gave_up else "")
    )


def parse_rows(spec: str, num_rows: int) -> list[int]:
    """``--rows`` as ``A:B`` (B excluded, either may be omitted) or a comma list; every
    row must exist."""
    spec = spec.strip()
    if ":" in spec:
        a, _, b = spec.partition(":")
        start, stop = int(a) if a else 0, int(b) if b else num_rows
        if not 0 <= start <= stop <= num_rows:
            raise ConfigurationError(f"rows {spec} outside the dataset's {num_rows}")
        return list(range(start, stop))
    out = [int(x) for x in spec.split(",") if x.strip()]
    bad = [i for i in out if not 0 <= i < num_rows]
    if bad:
        raise ConfigurationError(f"rows {bad[:5]} outside the dataset's {num_rows}")
    return list(dict.fromkeys(out))
