"""``python -m kv_connector.reader``: receive samples and write them as safetensors files.

Each sample becomes ``OUT/<request_id>.safetensors`` with ``hidden_states``
[num_tokens, num_layers, hidden] (producer dtype) and ``token_ids`` [num_tokens] int64,
written under a temporary name, fsynced and renamed, so a file under its final name is
always whole.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from kv_connector.control import parse_address
from kv_connector.metrics_server import MetricsAddressError
from kv_connector.reader.console import RunMonitor
from kv_connector.reader.core import HiddenStatesReader
from kv_connector.reader.files import write_atomically
from kv_connector.reader.lease import Sample
from kv_connector.reader.ledger import SAMPLE_TIMEOUT_S, RequireChecksum

log = logging.getLogger("kv_connector.reader")


LEDGER = ".ledger"


class Ledger:
    """Append-only record of the samples durably written to a directory."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LEDGER
        self.seen: set[tuple[str, str]] = set()
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                pid, _, rid = line.partition("\t")
                if rid:
                    self.seen.add((pid, rid))
        self._f = open(self.path, "a")  # noqa: SIM115 - kept open for the run

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self.seen

    def add(self, producer_id: str, request_id: str) -> None:
        self._f.write(f"{producer_id}\t{request_id}\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.seen.add((producer_id, request_id))

    def close(self) -> None:
        self._f.close()


def write_sample(out_dir: Path, sample: Sample, fsync: Callable[[int], None] = os.fsync) -> Path:
    """Write one sample atomically, from its view of the pool; returns the final path."""
    return write_atomically(
        out_dir / f"{sample.request_id}.safetensors",
        {"hidden_states": sample.hidden_states, "token_ids": sample.token_ids},
        {
            "request_id": sample.request_id,
            "producer_id": sample.producer_id,
            "layer_ids": ",".join(str(i) for i in sample.layer_ids),
        },
        fsync,
    )


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
    ap.add_argument("--out", required=True, help="directory for <request_id>.safetensors files")
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
    ap.add_argument("--log-level", default="INFO")
    return ap


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
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".probe."):
            pass
    except OSError as e:
        return fail(f"cannot write to {out}: {e.strerror or e}")
    for stale in out.glob(".*.tmp"):  # partial files of a run that was killed mid-write
        stale.unlink(missing_ok=True)
    ledger = Ledger(out)
    listen: str | socket.socket = args.listen
    if args.listen_fd is not None:
        try:
            listen = socket.socket(fileno=args.listen_fd)
        except OSError as e:
            return fail(f"--listen-fd {args.listen_fd}: {e.strerror or e}")
    try:
        reader = HiddenStatesReader(
            listen=listen,
            pool_bytes=int(args.pool_mib * (1 << 20)),
            ack="manual",
            already_delivered=lambda pid, rid: (pid, rid) in ledger,
            require_checksum=args.require_checksum,
            sample_timeout_s=args.sample_timeout,
            insecure=args.insecure,
            metrics_address=args.metrics,
        )
    except MetricsAddressError as e:
        return fail(str(e.strerror))
    except OSError as e:
        return fail(f"cannot listen on {args.listen}: {e.strerror or e}")
    except ValueError as e:
        return fail(str(e))

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    print(reader.address, flush=True)
    if reader.metrics_address is not None:
        print(reader.metrics_address, flush=True)
    monitor = RunMonitor(reader)  # the progress line, file metrics, the summary at exit
    n = 0
    try:
        with reader:
            for sample in reader.samples(args.max_samples, args.timeout):
                with sample:  # its pages return once the file is written
                    path = write_sample(out, sample, monitor.files.fsync)
                    ledger.add(sample.producer_id, sample.request_id)
                    reader.ack(sample)  # only now may the producer free the sample's blocks
                monitor.files.written(path)
                n += 1
                log.log(
                    logging.DEBUG if monitor.live else logging.INFO,
                    "wrote %s (%d tokens)",
                    path.name,
                    sample.token_ids.numel(),
                )
    except TimeoutError as e:
        print(f"error: {e}; wrote {n} samples", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        log.info("interrupted after %d samples", n)
        return 130
    finally:
        ledger.close()
        monitor.close()
    log.info("done: %d samples in %s", n, out)
    return 0
