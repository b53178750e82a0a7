"""Faults on the consumer side with real processes: the reader CLI killed mid-stream and
restarted, and a reader that starts after its producer. The producer reconnects and
resends what was not acknowledged; every sample ends up written exactly once."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from kv_connector.files.journal import Journal
from kv_connector.wire.layout import BlockLayout
from tests.integration.common import (
    expected_states,
    finish_sender,
    layout_dict,
    make_cache,
    same_bytes,
    start_sender,
    token_ids,
)
from tests.ports import address_of, held_port

pytestmark = pytest.mark.integration

LAYOUT = BlockLayout("LTH", 16, 2, 64, "float32")
CACHE_BLOCKS = 64


def start_cli(held: socket.socket, out: Path, n: int, pool_blocks: int) -> subprocess.Popen[str]:
    """The reader CLI on the test's held socket (``--listen-fd``): a restart listens on
    the same port without it ever being released."""
    pool_mib = pool_blocks * LAYOUT.block_bytes / (1 << 20)
    return subprocess.Popen(
        [sys.executable, "-m", "kv_connector.reader", "--listen-fd", str(held.fileno()), "--out", str(out),
         "--max-samples", str(n), "--pool-mib", f"{pool_mib:.6f}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(held.fileno(),),
    )  # fmt: skip


def plan(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = rng.randint(1, 3 * LAYOUT.block_size)
        nb = -(-tokens // LAYOUT.block_size)
        out.append(
            {
                "request_id": f"r{seed}-{i}",
                "num_tokens": tokens,
                "block_ids": rng.sample(range(CACHE_BLOCKS), nb),
            }
        )
    return out


def journal_entries(out: Path) -> int:
    j = Journal(out)
    try:
        return len(j)
    finally:
        j.close()


def check_dir(out: Path, samples: list[dict[str, Any]], seed: int) -> None:
    cache = make_cache(LAYOUT, CACHE_BLOCKS, seed, finite=True)
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != ".delivered")
    assert names == sorted(f"producer/{s['request_id']}.safetensors" for s in samples)
    # one journal record per sample: none was written twice
    assert journal_entries(out) == len(samples), "a sample was written twice"
    assert not os.listdir(out / ".tmp")
    for s in samples:
        with safe_open(str(out / "producer" / f"{s['request_id']}.safetensors"), "pt") as f:
            hs, tok = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        assert tok.tolist() == token_ids(s["request_id"], s["num_tokens"])
        assert same_bytes(hs, expected_states(cache, LAYOUT, s["block_ids"], s["num_tokens"]))


def test_reader_killed_mid_stream_and_restarted_ends_with_every_sample_once(tmp_path: Path) -> None:
    held, out, seed = held_port(), tmp_path / "out", 31
    samples = plan(40, seed)
    cli = start_cli(held, out, len(samples), pool_blocks=3)
    sender = start_sender(
        dict(address=address_of(held), layout=layout_dict(LAYOUT), num_cache_blocks=CACHE_BLOCKS,
             seed=seed, finite=True, samples=samples, connect_timeout_s=120, timeout_s=240)
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list(out.glob("*/*.safetensors"))) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(cli.pid, signal.SIGKILL)  # mid-stream: the pool is full, samples are in flight
        cli.communicate()
        written = journal_entries(out)
        assert 8 <= written < len(samples)
        time.sleep(1.0)
        cli = start_cli(held, out, len(samples) - written, pool_blocks=3)
        _, err = cli.communicate(timeout=240)  # (closes its pipes: wait() left them open)
        assert cli.returncode == 0, err
        res = finish_sender(sender, timeout=240)
    finally:
        held.close()
        for p in (cli, sender):
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    assert sorted(res["finished"]) == sorted(s["request_id"] for s in samples)
    assert "will be resent" in res["stderr"]
    check_dir(out, samples, seed)


def test_reader_started_after_the_producer_receives_everything(tmp_path: Path) -> None:
    held, out, seed = held_port(), tmp_path / "out", 32
    samples = plan(6, seed)
    sender = start_sender(
        dict(address=address_of(held), layout=layout_dict(LAYOUT), num_cache_blocks=CACHE_BLOCKS,
             seed=seed, finite=True, samples=samples, connect_timeout_s=60)
    )  # fmt: skip
    cli = None
    try:
        time.sleep(4)  # the producer is already retrying
        cli = start_cli(held, out, len(samples), pool_blocks=16)
        _, err = cli.communicate(timeout=120)
        assert cli.returncode == 0, err
        res = finish_sender(sender)
    finally:
        held.close()
        for p in (cli, sender):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert res["rc"] == 0 and not res["failed"]
    assert "not reachable" in res["stderr"] and "retrying" in res["stderr"]
    check_dir(out, samples, seed)


def test_no_reader_at_all_fails_each_request_clearly_after_the_deadline() -> None:
    samples = plan(3, 33)
    t0 = time.monotonic()
    with held_port() as held:  # ours, and refusing connections: no reader will ever be there
        res = finish_sender(
            start_sender(
                dict(
                    address=address_of(held),
                    layout=layout_dict(LAYOUT),
                    num_cache_blocks=CACHE_BLOCKS,
                    seed=33,
                    samples=samples,
                    connect_timeout_s=2.0,
                )
            )
        )
    assert res["rc"] == 1 and sorted(res["failed"]) == sorted(s["request_id"] for s in samples)
    assert all("cannot reach the reader" in why and "2 s" in why for why in res["failed"].values())
    assert time.monotonic() - t0 < 60
