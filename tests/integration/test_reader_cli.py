"""The reader CLI: prints its real address, writes whole safetensors files, exits 0 after
--max-samples, and turns bad arguments into one-line errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from kv_connector.layout import BlockLayout
from tests.integration.common import (
    expected_states,
    finish_sender,
    layout_dict,
    make_cache,
    same_bytes,
    start_sender,
    token_ids,
)

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "kv_connector.reader"]


def test_cli_writes_each_sample_atomically_and_exits_after_max_samples(tmp_path: Path) -> None:
    layout = BlockLayout("LTH", 16, 2, 32, "float32")
    out = tmp_path / "out"
    samples = [
        {"request_id": "a-1", "num_tokens": 1, "block_ids": [3]},
        {"request_id": "b-2", "num_tokens": 40, "block_ids": [9, 1, 5]},
        {"request_id": "c-3", "num_tokens": 16, "block_ids": [0]},
    ]
    cli = subprocess.Popen(
        [*CLI, "--listen", "127.0.0.1:0", "--out", str(out), "--max-samples", "3", "--pool-mib", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert cli.stdout is not None
        address = cli.stdout.readline().strip()
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        proc = start_sender(
            dict(address=address, layout=layout_dict(layout), num_cache_blocks=16, seed=9, samples=samples)
        )
        res = finish_sender(proc)
        assert cli.wait(timeout=60) == 0, cli.stderr.read() if cli.stderr else ""
    finally:
        cli.kill()
        cli.communicate()
    assert res["rc"] == 0
    assert sorted(os.listdir(out)) == [".ledger", "a-1.safetensors", "b-2.safetensors", "c-3.safetensors"]
    ledger = (out / ".ledger").read_text().splitlines()
    assert sorted(ln.split("\t")[1] for ln in ledger) == ["a-1", "b-2", "c-3"]
    cache = make_cache(layout, 16, 9)
    for s in samples:
        with safe_open(str(out / f"{s['request_id']}.safetensors"), "pt") as f:
            hs, tok = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
            assert f.metadata()["layer_ids"] == "0,1"
        assert tok.tolist() == token_ids(s["request_id"], s["num_tokens"])
        assert same_bytes(hs, expected_states(cache, layout, s["block_ids"], s["num_tokens"]))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)


def test_cli_bad_arguments_end_in_one_line_errors(tmp_path: Path) -> None:
    busy = socket.create_server(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    try:
        cases = {
            "unparsable": run_cli("--listen", "nonsense", "--out", str(tmp_path)),
            "busy": run_cli("--listen", f"127.0.0.1:{port}", "--out", str(tmp_path / "o")),
            "unwritable": run_cli("--listen", "127.0.0.1:0", "--out", str(blocker / "sub")),
        }
    finally:
        busy.close()
    for name, r in cases.items():
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert r.returncode != 0, name
        assert len(errors) == 1 and "Traceback" not in r.stderr, (name, r.stderr)
    assert "HOST:PORT" in cases["unparsable"].stderr
    assert "in use" in cases["busy"].stderr
    assert "cannot write" in cases["unwritable"].stderr
