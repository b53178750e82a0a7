"""The reader's Prometheus endpoint, scraped for real while real sender processes ship
over NIXL: the reader CLI's ``--metrics`` (samples, tokens and bytes per producer, pool
pages, files and fsyncs, exactly what was sent and written) and the library's
``metrics_address`` (pages on lease, checksum failures and refusals by reason, a socket
the caller bound); the progress log lines and the summary at exit."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kv_connector.datagen.httpclient import Server
from kv_connector.reader import HiddenStatesReader
from kv_connector.reader.push.ledger import MAX_REWRITES
from kv_connector.wire.layout import BlockLayout
from tests.integration.common import (
    CPU_LAYOUT,
    NUM_CACHE_BLOCKS,
    Senders,
    finish_sender,
    layout_dict,
    plan,
    start_sender,
)
from tests.ports import address_of, held_port
from tests.promtext import excerpt, scrape, value, wait_for_values

pytestmark = pytest.mark.integration

R = "hidden_states_reader_"


def ship_to(
    address: str, layout: BlockLayout, seed: int, samples: list[dict[str, Any]], producer_id: str
) -> subprocess.Popen[str]:
    return start_sender(
        dict(
            address=address,
            layout=layout_dict(layout),
            num_cache_blocks=NUM_CACHE_BLOCKS,
            seed=seed,
            finite=True,  # the CLI refuses non-finite hidden states
            samples=samples,
            producer_id=producer_id,
        )
    )


def payload(layout: BlockLayout, samples: list[dict[str, Any]]) -> tuple[int, int]:
    """(tokens, bytes of hidden_states) of ``samples``."""
    tokens = sum(s["num_tokens"] for s in samples)
    return tokens, tokens * layout.token_bytes


def test_the_cli_serves_what_it_received_and_wrote(tmp_path: Path) -> None:
    layout = CPU_LAYOUT
    a = plan([1, 16, 40], seed=21, layout=layout)
    b = plan([17, 5], seed=22, layout=layout)
    out = tmp_path / "out"
    cli = subprocess.Popen(
        [sys.executable, "-m", "kv_connector.reader", "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
         "--out", str(out), "--pool-mib", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert cli.stdout is not None
        address, metrics = cli.stdout.readline().strip(), cli.stdout.readline().strip()
        host, port = metrics.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        http = Server(f"http://{metrics}")
        _, before = scrape(http)
        assert value(before, R + "producers_connected") == 0
        assert value(before, R + "pool_pages", state="free") == 0  # no page size before a producer
        procs = [ship_to(address, layout, 21, a, "A"), ship_to(address, layout, 22, b, "B")]
        results = [finish_sender(p) for p in procs]
        assert all(r["rc"] == 0 for r in results), [r["stderr"][-2000:] for r in results]
        (ta, ba), (tb, bb) = payload(layout, a), payload(layout, b)
        text, m = wait_for_values(
            http,
            [
                (R + "samples_received_total", {"producer": "A"}, 3),
                (R + "samples_received_total", {"producer": "B"}, 2),
                (R + "tokens_received_total", {"producer": "A"}, ta),
                (R + "tokens_received_total", {"producer": "B"}, tb),
                (R + "received_bytes_total", {"producer": "A"}, ba),
                (R + "received_bytes_total", {"producer": "B"}, bb),
                (R + "files_written_total", {}, 5),
                (R + "fsync_seconds_count", {}, 10),  # each file, then its directory
                (R + "pool_pages", {"state": "leased"}, 0),
                (R + "pool_pages", {"state": "granted"}, 0),
                (R + "producers_connected", {}, 0),  # both senders closed
                # every page free: a credit granted as its producer left waits a quarantine
                (R + "pool_pages", {"state": "quarantined"}, 0),
            ],
            timeout=30,
        )
        files = sorted(out.rglob("*.safetensors"))
        assert len(files) == 5
        assert value(m, R + "file_bytes_total") == sum(f.stat().st_size for f in files)
        pages = value(m, R + "pool_pages", state="free")
        assert pages is not None and pages == (1 << 20) // value(m, R + "pool_page_bytes")  # type: ignore[operator]
        assert value(m, R + "handout_latency_seconds_count") == 5
        assert value(m, R + "checksum_failures_total") == 0
        assert value(m, R + "samples_refused_total", reason="checksum") == 0
        print(excerpt(text, R))
        cli.send_signal(signal.SIGTERM)
        _, err = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.communicate()
    assert cli.returncode == 130
    summary = [ln for ln in err.splitlines() if "received 5 samples" in ln]
    assert summary and f"{ta + tb:,} tokens" in summary[0] and "5 files written" in summary[0], err[-3000:]
    # the sender's own counters agree: every block of every sample written once
    for res, samples in zip(results, (a, b), strict=True):
        blocks = sum(-(-s["num_tokens"] // layout.block_size) for s in samples)
        assert res["stats"]["bytes"] == blocks * layout.block_bytes
        assert res["stats"]["writes"] == len(samples)


def test_a_bad_metrics_address_ends_in_one_error_line(tmp_path: Path) -> None:
    busy = held_port()
    busy.listen()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "kv_connector.reader", "--out", str(tmp_path),
             "--metrics", address_of(busy)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        busy.close()
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "cannot serve metrics on" in errors[0] and "in use" in errors[0]


def test_the_library_serves_leases_checksum_failures_and_refusals(senders: Senders) -> None:
    layout = CPU_LAYOUT
    good = plan([20, 33], seed=23, layout=layout)
    bad = plan([5], seed=24, layout=layout)
    huge = plan([70], seed=25, layout=layout)  # 5 blocks, the pool holds 4
    sock = held_port()  # the metrics port is ours from the start, never released
    with HiddenStatesReader(pool_bytes=4 * layout.block_bytes, metrics_address=sock) as reader:
        assert reader.metrics_address == address_of(sock)
        http = Server(f"http://{reader.metrics_address}")
        proc = senders.ship(reader, layout, 23, good, producer_id="good")
        first = reader.get(timeout=30)  # on lease: its pages stay taken
        held = -(-first.token_ids.numel() // layout.block_size)
        wait_for_values(http, [(R + "pool_pages", {"state": "leased"}, held)], timeout=10)
        first.release()
        second = reader.get(timeout=30, copy=True)
        assert finish_sender(proc)["rc"] == 0
        # every WRITE of it lands damaged (a faulty transport in the sender)
        corrupt = senders.ship(reader, layout, 24, bad, producer_id="bad", garble=[bad[0]["request_id"]])
        res = finish_sender(corrupt)
        assert (
            list(res["failed"]) == [bad[0]["request_id"]]
            and "checksum" in res["failed"][bad[0]["request_id"]]
        )
        refused = finish_sender(senders.ship(reader, layout, 25, huge, producer_id="huge"))
        assert "pool_too_small" in next(iter(refused["failed"].values()))
        tokens, nbytes = payload(layout, good)
        text, m = wait_for_values(
            http,
            [
                (R + "samples_received_total", {"producer": "good"}, 2),
                (R + "received_bytes_total", {"producer": "good"}, nbytes),
                (R + "tokens_received_total", {"producer": "good"}, tokens),
                (R + "checksum_failures_total", {}, MAX_REWRITES + 1),
                (R + "samples_refused_total", {"reason": "checksum"}, 1),
                (R + "samples_refused_total", {"reason": "pool_too_small"}, 1),
                (R + "samples_dropped_total", {}, 1),
                (R + "pool_pages", {"state": "leased"}, 0),
                (R + "connections_refused_total", {}, 0),
            ],
            timeout=30,
        )
        assert value(m, R + "samples_received_total", producer="bad") is None  # never handed out
        assert second.request_id != first.request_id
        print(excerpt(text, R))
    with pytest.raises(OSError):
        scrape(http)  # closed with the reader
