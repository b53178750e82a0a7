"""``python -m kv_connector.reader``: receive samples and write them as safetensors files.

Each sample becomes one file (``reader.naming``: ``OUT/<producer_id>/<request_id>.safetensors``
by default, ``OUT/hs_<row>.safetensors`` with ``--layout speculators``) holding
``hidden_states`` [num_tokens, num_layers, hidden] (producer dtype; with ``--fp8``
float8_e4m3fn beside float32 ``hidden_states_scales``, speculators' fp8 layout:
``files.fp8``) and ``token_ids`` [num_tokens] int64, and in its metadata the request,
producer and sample ids, the sample's metadata (JSON) and the layer ids. It is written from
the sample's view of the pool under a temporary name in ``OUT/.tmp/``, fsynced and renamed,
so a file under its final name is always whole; then its key goes into the delivery journal
(``reader.journal``), and only then is the producer acknowledged.

A sample that cannot be taken is refused to its producer with the reason, and the CLI
goes on: its states hold NaN/Inf or an all-zero token (``reader.pool.values``; on by default),
or its file cannot be written for a reason of its own (a name or content the file system
or the format refuses). A failure of the disk itself (full, read-only, I/O error) ends
the CLI with one ``error:`` line and exit code 1, without acknowledging the sample: its
producer resends it to the next reader.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import msgspec

from kv_connector.common.errors import ConfigurationError
from kv_connector.files.console import RunMonitor
from kv_connector.files.fp8 import SCALES_KEY, Fp8Scale, quantize
from kv_connector.files.journal import Journal, JournalLocked
from kv_connector.files.naming import UNNAMED, FileLayout, sample_path
from kv_connector.files.safetensors_io import write_atomically
from kv_connector.reader import (
    SAMPLE_TIMEOUT_S,
    HiddenStatesReader,
    MetricsAddressError,
    RequireChecksum,
    Sample,
    find_bad_values,
    refuse_open_listen,
)
from kv_connector.wire import auth
from kv_connector.wire.control import parse_address
from kv_connector.wire.layout import DType
from kv_connector.wire.provenance import Expectation

log = logging.getLogger("kv_connector.reader")

TMP_DIR = ".tmp"
# the text ledger of earlier versions
OLD_LEDGER = ".ledger"
# errors of one sample's file (its name, its content): refused to its producer; any other
# OSError is the disk's (full, read-only, I/O error...) and ends the CLI without an ack
PER_SAMPLE_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ, errno.ENOTDIR, errno.EISDIR})


class DiskError(ConfigurationError):
    """Writing failed for a reason that is not the sample's: stop, acknowledge nothing."""


def per_sample(error: BaseException) -> bool:
    """Does this write error belong to the sample (refuse it, go on) rather than to the
    disk (stop)?"""
    if isinstance(error, OSError):
        return error.errno in PER_SAMPLE_ERRNOS
    return isinstance(error, (ValueError, TypeError, RuntimeError, UnicodeError))


def file_metadata(sample: Sample) -> dict[str, str]:
    """A sample's file header: who it is, its layers, and what produced it (where its
    producer said: vLLM version, model runner, model, revision)."""
    meta = {
        "request_id": sample.request_id,
        "producer_id": sample.producer_id,
        "sample_id": sample.sample_id,
        "metadata": json.dumps(sample.metadata, separators=(",", ":"), ensure_ascii=False),
        "layer_ids": ",".join(str(i) for i in sample.layer_ids),
    }
    if sample.provenance is not None:
        meta.update(sample.provenance.as_dict())
    return meta


def write_sample(
    path: Path,
    sample: Sample,
    tmp_dir: Path | None = None,
    fsync: Callable[[int], None] = os.fsync,
    fp8: Fp8Scale | None = None,
) -> Path:
    """Write one sample atomically, from its view of the pool (with ``fp8``, quantized in
    speculators' fp8 layout, ``files.fp8``); returns the final path."""
    meta = file_metadata(sample)
    if fp8 is None:
        tensors = {"hidden_states": sample.hidden_states, "token_ids": sample.token_ids}
    else:
        states, scales = quantize(sample.hidden_states, fp8)
        tensors = {"hidden_states": states, SCALES_KEY: scales, "token_ids": sample.token_ids}
        meta["fp8_scale"] = fp8.value
        # before quantizing
        meta["dtype"] = str(sample.hidden_states.dtype).removeprefix("torch.")
    return write_atomically(path, tensors, meta, tmp_dir, fsync)


class SampleFiles:
    """Takes each sample the reader hands out: checks it, writes its file, records it in
    the journal, acknowledges it; or refuses it to its producer, saying why."""

    def __init__(
        self,
        reader: HiddenStatesReader,
        out: Path,
        layout: FileLayout,
        journal: Journal,
        check: bool,
        monitor: RunMonitor | None = None,
        fp8: Fp8Scale | None = None,
    ) -> None:
        self.reader, self.out, self.layout, self.journal, self.check = reader, out, layout, journal, check
        # write speculators' fp8 layout, with scales per token (or layer)
        self.fp8 = fp8
        # file metrics and the progress line, if any
        self.monitor = monitor
        self.tmp = out / TMP_DIR
        self._dirs: set[Path] = {out, self.tmp}
        self.written = self.rejected = self.unnamed = 0

    def take(self, sample: Sample) -> None:
        """Raises ``DiskError`` when the file system fails (nothing acknowledged)."""
        rel = sample_path(self.layout, sample.producer_id, sample.request_id, sample.sample_id)
        name = f"{sample.request_id} of {sample.producer_id}"
        if sample.sample_id != sample.request_id:
            name += f" (sample {sample.sample_id})"
        if self.check:
            problem = find_bad_values(sample.hidden_states, sample.layer_ids)
            if problem is not None:
                self._reject(sample, name, f"bad hidden states: {problem}")
                return
        path = self.out / rel
        try:
            self._ensure_dir(path.parent)
            fsync = self.monitor.files.fsync if self.monitor else os.fsync
            write_sample(path, sample, self.tmp, fsync, self.fp8)
        except Exception as e:
            if not per_sample(e):
                raise DiskError(f"cannot write {path}: {e}") from e
            self._reject(sample, name, f"the reader cannot write its file {rel}: {e}")
            return
        try:
            self.journal.add(sample.producer_id, sample.request_id)
        except OSError as e:
            raise DiskError(f"cannot record {name} in {self.journal.path}: {e}") from e
        # only now may the producer free the sample's blocks
        self.reader.ack(sample)
        self.written += 1
        if self.monitor is not None:
            self.monitor.files.written(path)
        if rel.parts[0] == UNNAMED and self.layout is FileLayout.SPECULATORS:
            self.unnamed += 1
            log.warning("%s: no integer sample id, written to %s (speculators does not read it)", name, rel)
        else:
            # the progress line says it
            live = self.monitor is not None and self.monitor.live
            log.log(
                logging.DEBUG if live else logging.INFO, "wrote %s (%d tokens)", rel, sample.token_ids.numel()
            )

    def _reject(self, sample: Sample, name: str, why: str) -> None:
        log.error("refused %s: %s", name, why)
        self.reader.reject(sample, why)
        self.rejected += 1

    def _ensure_dir(self, directory: Path) -> None:
        if directory in self._dirs:
            return
        self._ensure_dir(directory.parent)
        try:
            directory.mkdir()
        except FileExistsError:
            # a file in the way: this name's samples cannot be written
            if not directory.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(directory)) from None
        else:
            # the new directory's entry is durable before a file in it
            _fsync_dir(directory.parent)
        self._dirs.add(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kv_connector.reader",
        description="Receive hidden states from producers and write one safetensors file per sample.",
    )
    ap.add_argument(
        "--listen", default="127.0.0.1:0", help="control address HOST:PORT (port 0: any free port)"
    )
    ap.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="listen on this inherited file descriptor, a TCP socket already bound by a supervisor "
        "(systemd socket activation, a test harness); --listen is then ignored",
    )
    ap.add_argument("--out", required=True, help="directory for the samples' files")
    ap.add_argument(
        "--layout",
        choices=[x.value for x in FileLayout],
        default=FileLayout.DEFAULT.value,
        help="default: OUT/<producer_id>/<request_id>.safetensors; speculators: OUT/hs_<sample_id>"
        ".safetensors for integer sample ids (what speculators' ArrowDataset reads), others in OUT/unnamed/",
    )
    ap.add_argument(
        "--fp8",
        nargs="?",
        const=Fp8Scale.TOKEN.value,
        choices=[x.value for x in Fp8Scale],
        default=None,
        help="write hidden_states as float8_e4m3fn with float32 hidden_states_scales, speculators' fp8 "
        "layout (its FP8Transfer reads it): one scale per token (--fp8, --fp8 token) or per token and "
        "layer (--fp8 layer: lower error where captured layers' magnitudes differ); half of bf16's bytes",
    )
    ap.add_argument(
        "--check-values",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="refuse samples whose states hold NaN/Inf or a token zero in every layer (default: on)",
    )
    ap.add_argument("--max-samples", type=int, default=None, help="exit 0 after this many samples")
    ap.add_argument("--pool-mib", type=float, default=256.0, help="receive pool size in MiB (default 256)")
    ap.add_argument(
        "--timeout", type=float, default=None, help="exit 1 if no sample arrives for this many seconds"
    )
    ap.add_argument(
        "--require-checksum",
        choices=[c.value for c in RequireChecksum],
        default=RequireChecksum.AUTO.value,
        help="refuse shares that come without a checksum: from producers whose cache is in host "
        "memory (auto, the default), from all (always), or from none (never)",
    )
    ap.add_argument(
        "--sample-timeout",
        type=float,
        default=SAMPLE_TIMEOUT_S,
        help=f"drop a sample not complete this many seconds after its pages were granted "
        f"(default {SAMPLE_TIMEOUT_S:.0f})",
    )
    ap.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --listen without a shared secret (KV_CONNECTOR_SECRET[_FILE]); "
        "anyone who reaches the port can then write into the reader's memory",
    )
    ap.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port); "
        "the address really served is printed as the second line",
    )
    expect = ap.add_argument_group(
        "what every sample must be",
        "a sample that differs is refused to its producer by name, counted (refused_mismatch, the "
        "metrics' refusals by reason) and never written; unset: anything is taken",
    )
    expect.add_argument(
        "--expect-layers", metavar="IDS", default=None, help="the captured layer ids, in order: 1,2,4"
    )
    expect.add_argument(
        "--expect-model",
        metavar="NAME",
        default=None,
        help="the producer's model, exactly or as its last path components (Qwen/Qwen3-8B "
        "matches /models/Qwen/Qwen3-8B)",
    )
    expect.add_argument("--expect-dtype", choices=list(get_args(DType)), default=None)
    expect.add_argument("--expect-hidden-size", type=int, metavar="N", default=None)
    ap.add_argument("--log-level", default="INFO")
    return ap


def expectation(args: argparse.Namespace) -> Expectation | None:
    """The ``--expect-*`` flags as the reader's ``expect``; None when none is given.
    ``ValueError`` names a bad value."""
    layers: list[int] | None = None
    if args.expect_layers is not None:
        try:
            layers = [int(x) for x in args.expect_layers.split(",")]
        except ValueError:
            bad = args.expect_layers
            raise ConfigurationError(f"--expect-layers: comma-separated integers, not {bad!r}") from None
    given = {
        "layer_ids": layers,
        "dtype": args.expect_dtype,
        "hidden_size": args.expect_hidden_size,
        "model": args.expect_model,
    }
    if all(v is None for v in given.values()):
        return None
    try:
        return msgspec.convert(given, Expectation)
    except (msgspec.ValidationError, ValueError) as e:
        raise ConfigurationError(f"--expect-*: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    try:
        parse_address(args.listen)
        if args.metrics is not None:
            parse_address(args.metrics)
    except ValueError as e:
        return fail(str(e))
    if args.max_samples is not None and args.max_samples <= 0:
        return fail("--max-samples must be positive")
    if args.pool_mib <= 0:
        return fail("--pool-mib must be positive")
    if not args.sample_timeout > 0:
        return fail("--sample-timeout must be positive")
    try:
        expect = expectation(args)
    except ValueError as e:
        return fail(str(e))
    # before anything is made on disk: a secret that is set but empty, an open listen
    try:
        secret = auth.load_secret()
        if not secret and not args.insecure and args.listen_fd is None:
            refuse_open_listen(parse_address(args.listen)[0], args.listen)
    except ValueError as e:
        return fail(str(e))
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".probe."):
            pass
    except OSError as e:
        return fail(f"cannot write to {out}: {e.strerror or e}")
    # partial files of a run killed mid-write
    shutil.rmtree(out / TMP_DIR, ignore_errors=True)
    try:
        (out / TMP_DIR).mkdir(exist_ok=True)
        journal = Journal(out)
    except JournalLocked as e:
        return fail(f"{e}: one reader per output directory")
    except (OSError, ValueError) as e:
        return fail(f"cannot open the delivery journal in {out}: {e}")
    if (out / OLD_LEDGER).exists():
        log.warning(
            "%s is the ledger of an earlier version and is not read: samples it lists are written "
            "again if their producers resend them",
            out / OLD_LEDGER,
        )
    listen: str | socket.socket = args.listen
    if args.listen_fd is not None:
        try:
            listen = socket.socket(fileno=args.listen_fd)
        except OSError as e:
            journal.close()
            return fail(f"--listen-fd {args.listen_fd}: {e.strerror or e}")
    try:
        reader = HiddenStatesReader(
            listen=listen,
            pool_bytes=int(args.pool_mib * (1 << 20)),
            ack="manual",
            already_delivered=lambda pid, rid: (pid, rid) in journal,
            require_checksum=args.require_checksum,
            sample_timeout_s=args.sample_timeout,
            secret=secret,
            insecure=args.insecure,
            metrics_address=args.metrics,
            # the files' own check below reads every value (--check-values)
            check_values=False,
            expect=expect,
        )
    except MetricsAddressError as e:
        journal.close()
        return fail(str(e.strerror))
    except OSError as e:
        journal.close()
        return fail(f"cannot listen on {args.listen}: {e.strerror or e}")
    except ValueError as e:
        journal.close()
        return fail(str(e))

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    print(reader.address, flush=True)
    if reader.metrics_address is not None:
        print(reader.metrics_address, flush=True)
    if expect is not None:
        log.info("taking only samples that are %s", describe(expect))
    # the progress line, file metrics, the summary at exit
    monitor = RunMonitor(reader)
    fp8 = Fp8Scale(args.fp8) if args.fp8 is not None else None
    files = SampleFiles(reader, out, FileLayout(args.layout), journal, args.check_values, monitor, fp8)
    n = 0
    try:
        with reader:
            for sample in reader.samples(args.max_samples, args.timeout):
                # its pages return once the file is written (or it is refused)
                with sample:
                    files.take(sample)
                n += 1
    except DiskError as e:
        print(
            f"error: {e}; wrote {files.written} samples; this one was not acknowledged and its "
            "producer resends it to the next reader",
            file=sys.stderr,
        )
        return 1
    except TimeoutError as e:
        print(f"error: {e}; wrote {files.written} samples", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        log.info("interrupted after %d samples", n)
        return 130
    finally:
        journal.close()
        monitor.close()
        summary(files, reader.stats().refused_mismatch)
    return 0


def describe(expect: Expectation) -> str:
    """``expect`` in words: "layers [1, 2, 4], dtype bfloat16, ..."."""
    parts = [
        f"{name} {value}"
        for name, value in (
            ("layers", expect.layer_ids),
            ("dtype", expect.dtype),
            ("hidden size", expect.hidden_size),
            ("of model", expect.model),
        )
        if value is not None
    ]
    return ", ".join(parts)


def summary(files: SampleFiles, mismatched: int = 0) -> None:
    log.info("done: %d samples written to %s, %d refused", files.written, files.out, files.rejected)
    if mismatched:
        log.warning("%d samples were refused for not being what --expect-* says", mismatched)
    if files.unnamed:
        log.warning(
            "%d samples had no integer sample id and were written to %s (speculators does not read them)",
            files.unnamed,
            files.out / UNNAMED,
        )
