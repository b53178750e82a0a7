"""``python -m kv_connector.datagen``: send every row of a dataset to a producer vLLM.

Each row goes as a completion, so its hidden states stream to the reader. The driver
retries what failed, confirms what arrived and reports what did not.

Each row's token ids go to ``/v1/completions`` (``max_tokens`` 1) with
``kv_transfer_params = {"sample_id": "<row>"}``. N requests are in flight at once, on N
threads; the server batches them. What each answer means is ``plan.RowBook``'s to decide:

- "delivered" counts.
- "failed", or no answer (connection, 5xx, 429), is retried after a backoff, up to
  ``--retries`` times.
- A 4xx other than 429, or an answer that is not the connector's, gives the row up at once.
- "pending" is the usual answer for ``max_tokens`` 1: the sample is still on its way when
  the request finishes. It counts as delivered once the row's file appears in
  ``--check-dir`` (or the ``--skip-existing`` directory), written after its request went
  out. A row whose file does not come within ``--confirm-timeout`` is sent again.

Without a directory to look in, "pending" counts as delivered, unconfirmed. The connector
holds the request's blocks until the reader has the sample, and a failure after the answer
is only in the producer's log.

Exit 0 when every row was delivered, 1 when some were given up (listed), 2 on bad
arguments, an unreadable dataset or a server that never answered.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_connector.audit import (
    DEFAULT_MAX_ERROR,
    DEFAULT_POSITIONS,
    DEFAULT_RATE,
    AuditError,
    AuditResult,
    LogprobAudit,
    RowAudit,
)
from kv_connector.common.errors import ConfigurationError, RefusedError
from kv_connector.datagen import plan
from kv_connector.datagen.httpclient import HTTPError, Server
from kv_connector.datagen.plan import RowBook
from kv_connector.datagen.rows import DatasetRows, JsonlRows, Rows
from kv_connector.files.naming import row_index
from kv_connector.wire.outcome import OutcomeError, SampleOutcome, SampleStatus

log = logging.getLogger("kv_connector.datagen")

# (inode, mtime ns, size): a file replaced since has another
FileId = tuple[int, int, int]


def existing_rows(directory: Path) -> set[int]:
    """Rows whose ``hs_<row>.safetensors`` is in ``directory`` (one listing of it)."""
    out: set[int] = set()
    try:
        with os.scandir(directory) as it:
            for e in it:
                if e.name.startswith("hs_") and e.name.endswith(".safetensors"):
                    row = row_index(e.name[3 : -len(".safetensors")])
                    if row is not None:
                        out.add(row)
    except FileNotFoundError:
        pass
    return out


def file_id(path: Path) -> FileId | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class RequestFailed(RefusedError):
    def __init__(self, why: str, retry: bool = True) -> None:
        super().__init__(why)
        self.retry = retry


@dataclass
class Client:
    server: Server
    model: str
    timeout_s: float

    def complete(
        self, row: int, tokens: list[int], logprobs: bool = False
    ) -> tuple[SampleStatus, str, list[Any] | None]:
        """Send one row; the status its answer names, and the error for "failed".

        With ``logprobs`` it also returns vLLM's ``prompt_logprobs`` for the row, the
        audit's reference."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": tokens,
            "max_tokens": 1,
            "temperature": 0.0,
            "kv_transfer_params": {"sample_id": str(row)},
        }
        if logprobs:
            # each prompt token's own log-probability
            body["prompt_logprobs"] = 0
        try:
            resp = self.server.post_json("/v1/completions", body, timeout=self.timeout_s)
        except HTTPError as e:
            retry = e.status >= 500 or e.status == 429
            raise RequestFailed(f"HTTP {e.status}: {e.body[:500]}", retry) from None
        # ValueError: a body not JSON
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise RequestFailed(f"{type(e).__name__}: {e}") from None
        try:
            outcome = SampleOutcome.of(resp.get("kv_transfer_params"))
        except OutcomeError as e:
            raise RequestFailed(
                f"the answer carries no well-formed outcome ({e}): is the server running "
                "HiddenStatesConnector with extract_hidden_states?",
                retry=False,
            ) from None
        if outcome.sample_id != str(row):
            raise RequestFailed(f"the answer names sample {outcome.sample_id!r}, not {row}", retry=False)
        prompt = (resp.get("usage") or {}).get("prompt_tokens")
        if prompt is not None and prompt != len(tokens):
            raise RequestFailed(
                f"the server counted {prompt} prompt tokens, the row has {len(tokens)}", False
            )
        choices = resp.get("choices") or [{}]
        reference = choices[0].get("prompt_logprobs") if logprobs else None
        return outcome.status, outcome.error, reference if isinstance(reference, list) else None


def find_model(server: Server, wait_s: float) -> str:
    """The first model the server serves, waiting up to ``wait_s`` for it to answer."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            models = json.loads(server.get_text("/v1/models"))
            return str(models["data"][0]["id"])
        except (OSError, http.client.HTTPException, HTTPError, ValueError, KeyError, IndexError) as e:
            if time.monotonic() >= deadline:
                raise ConfigurationError(f"the server at {server.url} did not list its model: {e}") from None
        time.sleep(1.0)


class Run:
    """The threads of one run around a ``RowBook`` (its lock guards the book)."""

    def __init__(
        self,
        rows: Rows,
        todo: Sequence[int],
        lengths: Sequence[int],
        client: Client,
        concurrency: int,
        check_dir: Path | None,
        book: RowBook,
        audit: RowAudit | None = None,
    ) -> None:
        self.rows, self.client, self.check_dir, self.book = rows, client, check_dir, book
        self.audit = audit
        # audited rows: vLLM's prompt_logprobs
        self._references: dict[int, list[Any]] = {}
        self.audits: list[AuditResult] = []
        self.audit_failures: dict[int, str] = {}
        self.concurrency = concurrency
        self.tokens_total = sum(lengths[i] for i in todo)
        self._cond = threading.Condition()
        self._before: dict[int, FileId | None] = {}
        self._stop = False

    def path(self, row: int) -> Path:
        assert self.check_dir is not None
        return self.check_dir / f"hs_{row}.safetensors"

    def _worker(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stop or self.book.done:
                        return
                    row = self.book.take(time.monotonic())
                    if row is not None:
                        break
                    self._cond.wait(0.1)
                # what was there before: a file replaced since is new
                if self.check_dir is not None:
                    self._before[row] = file_id(self.path(row))
            audited = self.audit is not None and self.audit.wants(str(row))
            try:
                status, error, reference = self.client.complete(row, self.rows.tokens(row), audited)
            except RequestFailed as e:
                with self._cond:
                    log.debug("row %d: %s", row, e)
                    self.book.not_answered(row, str(e), time.monotonic(), e.retry)
                    self._cond.notify_all()
                continue
            # a row that cannot even be read: give it up, go on
            except Exception as e:
                with self._cond:
                    self.book.not_answered(row, f"{type(e).__name__}: {e}", time.monotonic(), retry=False)
                    self._cond.notify_all()
                continue
            with self._cond:
                if reference is not None:
                    self._references[row] = reference
                self.book.answered(row, status, error, time.monotonic())
                self._cond.notify_all()

    def _confirm(self) -> None:
        if self.check_dir is None:
            return
        with self._cond:
            waiting = [(r, self._before.get(r)) for r in self.book.awaiting()]
        seen = [r for r, before in waiting if (now := file_id(self.path(r))) is not None and now != before]
        failed = {r: why for r in seen if (why := self._audit(r)) is not None}
        with self._cond:
            t = time.monotonic()
            for r in seen:
                self.book.file_seen(r, t)
                if r in failed:
                    self.book.audit_failed(r, failed[r], t)
            for r in self.book.expire(t):
                log.warning("row %d: its file did not appear in %s; sending it again", r, self.check_dir)
            self._cond.notify_all()

    def _audit(self, row: int) -> str | None:
        """The logprob audit of an audited row whose file appeared: why it failed, or None.

        None means it passed or was not audited. A failed row's file is renamed
        ``.audit-failed``, so no trainer reads it."""

        with self._cond:
            reference = self._references.pop(row, None)
        if self.audit is None or reference is None:
            return None
        path = self.path(row)
        try:
            result = self.audit.check_file(path, str(row), reference)
        except (AuditError, OSError, ValueError) as e:
            log.warning("row %d: not audited: %s", row, e)
            return None
        self.audits.append(result)
        if result.passed(self.audit.max_error):
            return None
        why = (
            f"logprob audit: mean error {result.mean_error:.3g} (max {result.max_error:.3g}) at positions "
            f"{list(result.positions)}, over {self.audit.max_error}: these states are not the model's last "
            "layer's for these tokens"
        )
        os.replace(path, path.with_name(path.name + ".audit-failed"))
        self.audit_failures[row] = why
        log.error("row %d: %s", row, why)
        return why

    def progress(self, t0: float) -> tuple[plan.RunProgress, plan.Counts]:
        with self._cond:
            c = self.book.counts()
        p = plan.progress(
            c.rows, c.delivered + c.gave_up, self.tokens_total, c.tokens_delivered, time.monotonic() - t0
        )
        return p, c

    def run(self, progress_s: float, tty: bool) -> float:
        """Until every row is delivered or given up; returns the seconds it took."""
        t0 = time.monotonic()
        threads = [
            threading.Thread(target=self._worker, name=f"datagen-{k}", daemon=True)
            for k in range(self.concurrency)
        ]
        for th in threads:
            th.start()
        last = t0
        try:
            while True:
                with self._cond:
                    if self.book.done:
                        break
                    self._cond.wait(0.25)
                self._confirm()
                now = time.monotonic()
                if now - last >= (0.5 if tty else progress_s):
                    last = now
                    p, c = self.progress(t0)
                    if tty:
                        print("\r" + plan.bar(p, c.retries, c.gave_up), end="", file=sys.stderr, flush=True)
                    else:
                        print("datagen: " + plan.line(p, c.retries, c.gave_up), file=sys.stderr, flush=True)
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            for th in threads:
                th.join(timeout=self.client.timeout_s + 5)
        if tty:
            p, c = self.progress(t0)
            print("\r" + plan.bar(p, c.retries, c.gave_up), file=sys.stderr, flush=True)
        return time.monotonic() - t0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kv_connector.datagen",
        description="Send every row of a dataset to a vLLM server running HiddenStatesConnector, so "
        "that its hidden states stream to the reader (sample id = row index).",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", type=Path, help="a datasets directory (save_to_disk) with input_ids")
    src.add_argument("--jsonl", type=Path, help='a JSON-lines file of {"input_ids": [...]} rows')
    ap.add_argument(
        "--server", required=True, help="the producer's OpenAI server: http://HOST:PORT or unix:/path"
    )
    ap.add_argument("--model", default=None, help="model name for the requests (default: the server's first)")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32)")
    ap.add_argument("--rows", default=None, help="only these rows: A:B (B excluded) or a comma list")
    ap.add_argument(
        "--skip-existing", type=Path, default=None, help="skip rows whose hs_<row>.safetensors is in DIR"
    )
    ap.add_argument(
        "--check-dir",
        type=Path,
        default=None,
        help="confirm 'pending' rows by their file in DIR (default: the --skip-existing directory)",
    )
    ap.add_argument(
        "--confirm-timeout", type=float, default=120.0, help="seconds a pending row waits for its file"
    )
    ap.add_argument("--retries", type=int, default=3, help="requests per row after the first (default 3)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    ap.add_argument(
        "--wait-server", type=float, default=60.0, help="seconds to wait for the server to answer"
    )
    ap.add_argument(
        "--progress-s", type=float, default=10.0, help="seconds between progress lines off a terminal"
    )
    ap.add_argument(
        "--audit-model",
        type=Path,
        default=None,
        help="audit rows' states against vLLM's prompt_logprobs with this model's final norm and lm_head "
        "(its directory; only those two tensors are read); needs --check-dir and the model's last layer "
        "among the captured ids",
    )
    ap.add_argument(
        "--audit-rate", type=float, default=DEFAULT_RATE, help=f"rows audited (default {DEFAULT_RATE})"
    )
    ap.add_argument(
        "--audit-positions", type=int, default=DEFAULT_POSITIONS, help="positions audited a row"
    )
    ap.add_argument(
        "--audit-max-error",
        type=float,
        default=DEFAULT_MAX_ERROR,
        help=f"largest mean log-probability error that passes (default {DEFAULT_MAX_ERROR})",
    )
    ap.add_argument("--log-level", default="WARNING")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    if args.concurrency < 1 or args.retries < 0 or args.timeout <= 0 or args.confirm_timeout <= 0:
        return fail("--concurrency must be at least 1, --retries at least 0, the timeouts positive")
    try:
        server = Server(args.server.removesuffix("/").removesuffix("/v1"))
    except ValueError as e:
        return fail(str(e))
    try:
        rows: Rows = DatasetRows(args.dataset) if args.dataset is not None else JsonlRows(args.jsonl)
        todo = plan.parse_rows(args.rows, len(rows)) if args.rows else list(range(len(rows)))
        lengths = rows.lengths()
    except ValueError as e:
        return fail(str(e))
    skipped: set[int] = set()
    if args.skip_existing is not None:
        skipped = existing_rows(args.skip_existing) & set(todo)
        todo = [i for i in todo if i not in skipped]
    check_dir = args.check_dir or args.skip_existing
    if check_dir is not None and not check_dir.is_dir():
        return fail(f"{check_dir} is not a directory (the reader's --out)")
    audit = None
    if args.audit_model is not None:
        if check_dir is None:
            return fail("--audit-model reads each audited row's file: give --check-dir (the reader's --out)")
        if not 0 <= args.audit_rate <= 1 or args.audit_positions < 1 or args.audit_max_error <= 0:
            return fail("--audit-rate must be in 0..1, --audit-positions >= 1, --audit-max-error > 0")
        try:
            head = LogprobAudit.from_model(args.audit_model)
        except AuditError as e:
            return fail(str(e))
        audit = RowAudit(head, args.audit_rate, args.audit_positions, args.audit_max_error)
    try:
        model = args.model or find_model(server, args.wait_server)
    except ValueError as e:
        return fail(str(e))
    book = RowBook(
        {i: lengths[i] for i in todo},
        confirm=check_dir is not None,
        max_attempts=args.retries + 1,
        confirm_timeout_s=args.confirm_timeout,
    )
    print(
        f"datagen: {len(todo)} rows ({sum(lengths[i] for i in todo)} tokens) to {server.url} ({model}), "
        f"{args.concurrency} in flight"
        + (f"; {len(skipped)} skipped, already in {args.skip_existing}" if skipped else ""),
        file=sys.stderr,
        flush=True,
    )
    client = Client(server, model, args.timeout)
    run = Run(rows, todo, lengths, client, args.concurrency, check_dir, book, audit)
    interrupted = False
    try:
        elapsed = run.run(args.progress_s, sys.stderr.isatty())
    except KeyboardInterrupt:
        interrupted, elapsed = True, 0.0
    return report(run, book, elapsed, len(skipped), interrupted)


def report(run: Run, book: RowBook, elapsed: float, skipped: int, interrupted: bool) -> int:
    c = book.counts()
    failed = book.given_up()
    summary: dict[str, Any] = {
        "rows": c.rows,
        "delivered": c.delivered,
        "unconfirmed": c.unconfirmed,
        "failed": len(failed),
        "skipped": skipped,
        "retries": c.retries,
        "tokens": c.tokens_delivered,
        "elapsed_s": round(elapsed, 3),
        "rows_per_s": round(c.delivered / elapsed, 3) if elapsed > 0 else 0.0,
        "tokens_per_s": round(c.tokens_delivered / elapsed, 1) if elapsed > 0 else 0.0,
        "failed_rows": {str(i): why for i, why in sorted(failed.items())[:100]},
    }
    if run.audit is not None:
        summary["audited"] = len(run.audits)
        summary["audit_failed"] = len(run.audit_failures)
        summary["audit_mean_error_max"] = max((a.mean_error for a in run.audits), default=0.0)
    print(
        f"datagen: {c.delivered} of {c.rows} rows delivered in {elapsed:.1f} s "
        f"({summary['rows_per_s']} rows/s, {summary['tokens_per_s']} tokens/s), {c.retries} retries",
        file=sys.stderr,
    )
    if c.unconfirmed:
        print(
            f"datagen: {c.unconfirmed} rows were still on their way when answered (pending) and no "
            "directory was given to confirm them in (--check-dir): a later failure shows only in the "
            "producer's log",
            file=sys.stderr,
        )
    for i, why in sorted(failed.items())[:20]:
        print(f"datagen: row {i} failed: {why}", file=sys.stderr)
    if len(failed) > 20:
        print(f"datagen: ... and {len(failed) - 20} more rows failed", file=sys.stderr)
    if interrupted:
        print("datagen: interrupted", file=sys.stderr)
    print(json.dumps(summary), flush=True)
    return 0 if not failed and not interrupted and c.delivered == c.rows else 1
