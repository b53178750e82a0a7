"""The reader CLI: prints its real address, writes whole safetensors files under safe
names in either layout, exits 0 after --max-samples, refuses bad samples to their
producer and goes on, stops on a failing disk without acknowledging, and turns bad
arguments into one-line errors."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from kv_connector.files.journal import Journal
from kv_connector.files.naming import safe_name
from kv_connector.wire.layout import BlockLayout
from tests.integration.common import (
    CLI,
    expected_states,
    finish_sender,
    layout_dict,
    make_cache,
    same_bytes,
    start_cli,
    start_sender,
    stop_cli,
    token_ids,
)
from tests.ports import address_of, held_port

pytestmark = pytest.mark.integration

LAYOUT = BlockLayout("LTH", 16, 2, 32, "float32")


def send(
    address: str, samples: list[dict[str, Any]], producer: str = "producer", **kw: Any
) -> dict[str, Any]:
    spec = dict(address=address, layout=layout_dict(LAYOUT), num_cache_blocks=16, seed=9, finite=True,
                samples=samples, producer_id=producer, **kw)  # fmt: skip
    return finish_sender(start_sender(spec))


def check_file(
    path: Path,
    s: dict[str, Any],
    producer: str = "producer",
    layout: BlockLayout = LAYOUT,
    cache_blocks: int = 16,
) -> dict[str, str]:
    """The file holds exactly the sample's states and tokens; returns its metadata."""
    with safe_open(str(path), "pt") as f:
        hs, tok, meta = f.get_tensor("hidden_states"), f.get_tensor("token_ids"), f.metadata()
    assert tok.dtype == torch.int64 and tok.tolist() == token_ids(s["request_id"], s["num_tokens"])
    cache = make_cache(layout, cache_blocks, 9, finite=True)
    assert same_bytes(hs, expected_states(cache, layout, s["block_ids"], s["num_tokens"]))
    assert meta["layer_ids"] == "0,1" and meta["producer_id"] == producer
    assert meta["request_id"] == s["request_id"]
    assert meta["sample_id"] == s.get("sample_id", s["request_id"])
    assert json.loads(meta["metadata"]) == s.get("metadata", {})
    return meta


def test_cli_writes_each_sample_atomically_and_exits_after_max_samples(tmp_path: Path) -> None:
    out = tmp_path / "out"
    samples = [
        {"request_id": "a-1", "num_tokens": 1, "block_ids": [3]},
        {"request_id": "b-2", "num_tokens": 40, "block_ids": [9, 1, 5], "sample_id": "row-2",
         "metadata": {"source": "unit", "turn": 2}},
        {"request_id": "c-3", "num_tokens": 16, "block_ids": [0]},
    ]  # fmt: skip
    cli, address = start_cli(out, "--max-samples", "3")
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    res = send(address, samples)
    rc, err = stop_cli(cli)
    assert rc == 0, err[-3000:]
    assert res["rc"] == 0
    assert sorted(os.listdir(out)) == [".delivered", ".tmp", "producer"]
    assert not os.listdir(out / ".tmp")
    assert sorted(os.listdir(out / "producer")) == ["a-1.safetensors", "b-2.safetensors", "c-3.safetensors"]
    journal = Journal(out)
    assert len(journal) == 3 and all(("producer", s["request_id"]) in journal for s in samples)
    journal.close()
    for s in samples:
        check_file(out / "producer" / f"{s['request_id']}.safetensors", s)


def test_cli_names_files_safely_whatever_the_ids(tmp_path: Path) -> None:
    """Two producers sending the same request id get a file each (they used to share
    one); a request id of 256 characters (the protocol's longest) gets a name the file
    system takes (it used to end the CLI with ENAMETOOLONG, and again after each restart)."""
    out = tmp_path / "out"
    long_id = "L" * 200 + ":" + "x" * 55
    same = {"request_id": "cmpl-1", "num_tokens": 20, "block_ids": [2, 3]}
    longest = {"request_id": long_id, "num_tokens": 5, "block_ids": [7]}
    cli, address = start_cli(out, "--max-samples", "3")
    res_a = send(address, [same, longest], producer="prod-a")
    res_b = send(address, [same], producer="prod-b")
    rc, err = stop_cli(cli)
    assert rc == 0 and res_a["rc"] == 0 and res_b["rc"] == 0, err[-3000:]
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*.safetensors"))
    long_name = safe_name(long_id) + ".safetensors"
    assert files == sorted(["prod-a/cmpl-1.safetensors", "prod-b/cmpl-1.safetensors", f"prod-a/{long_name}"])
    assert len(long_name) < 120
    check_file(out / "prod-a" / "cmpl-1.safetensors", same, "prod-a")
    check_file(out / "prod-b" / "cmpl-1.safetensors", same, "prod-b")
    check_file(out / "prod-a" / long_name, longest, "prod-a")


def test_speculators_layout_names_files_by_row_and_a_regenerated_row_replaces_its_file(
    tmp_path: Path,
) -> None:
    out = tmp_path / "hidden_states"
    first = [
        {"request_id": "cmpl-a", "num_tokens": 20, "block_ids": [1, 2], "sample_id": "0"},
        {"request_id": "cmpl-b", "num_tokens": 3, "block_ids": [4], "sample_id": "1", "metadata": {"k": "v"}},
        {"request_id": "cmpl-c", "num_tokens": 5, "block_ids": [5]},  # no sample id
        {"request_id": "cmpl-d", "num_tokens": 5, "block_ids": [6], "sample_id": "row-7"},
    ]
    # row 1 generated again by a new request, with other states
    again = {"request_id": "cmpl-e", "num_tokens": 17, "block_ids": [8, 9], "sample_id": "1"}
    cli, address = start_cli(out, "--layout", "speculators", "--max-samples", "5")
    res = send(address, first)
    assert res["rc"] == 0, res["stderr"][-3000:]
    before = (out / "hs_1.safetensors").stat().st_ino
    res = send(address, [again])
    rc, err = stop_cli(cli)
    assert rc == 0 and res["rc"] == 0, err[-3000:]
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*.safetensors"))
    assert files == ["hs_0.safetensors", "hs_1.safetensors", "unnamed/producer/cmpl-c.safetensors",
                     "unnamed/producer/row-7.safetensors"]  # fmt: skip
    check_file(out / "hs_0.safetensors", first[0])
    check_file(out / "hs_1.safetensors", again)  # replaced, whole
    assert (out / "hs_1.safetensors").stat().st_ino != before
    check_file(out / "unnamed" / "producer" / "cmpl-c.safetensors", first[2])
    check_file(out / "unnamed" / "producer" / "row-7.safetensors", first[3])
    assert "2 samples had no integer sample id" in err and "unnamed" in err


def test_cli_refuses_samples_with_nan_or_zero_states_and_goes_on(tmp_path: Path) -> None:
    """Each bad sample is refused to its producer with the reason (which fails that
    request by name) and never written; the good ones around it are written."""
    out = tmp_path / "out"
    samples = [
        {"request_id": "good-1", "num_tokens": 20, "block_ids": [1, 2]},
        {"request_id": "nan-2", "num_tokens": 20, "block_ids": [3, 4], "poison": "nan"},
        {"request_id": "zero-3", "num_tokens": 20, "block_ids": [5, 6], "poison": "zero"},
        {"request_id": "good-4", "num_tokens": 3, "block_ids": [7]},
    ]
    cli, address = start_cli(out, "--max-samples", "4")
    res = send(address, samples)
    rc, err = stop_cli(cli)
    assert rc == 0, err[-3000:]
    assert res["rc"] == 1 and sorted(res["finished"]) == ["good-1", "good-4"]
    assert set(res["failed"]) == {"nan-2", "zero-3"}
    assert (
        "rejected" in res["failed"]["nan-2"]
        and "NaN/Inf at 1 of 20 tokens: token 0 (layer ids 0)" in (res["failed"]["nan-2"])
    )
    assert "1 of 20 tokens all zero in every layer: token 0" in res["failed"]["zero-3"]
    assert "refused nan-2 of producer" in err and "refused zero-3 of producer" in err
    assert sorted(os.listdir(out / "producer")) == ["good-1.safetensors", "good-4.safetensors"]
    journal = Journal(out)
    assert len(journal) == 2
    journal.close()


def test_cli_takes_only_what_its_expect_flags_say_and_refuses_the_rest_by_name(tmp_path: Path) -> None:
    """``--expect-*``: another model's samples, or other layers, are refused to their
    producer naming the difference, never written, and counted in the summary; the expected
    producer's sample is written."""
    out = tmp_path / "out"
    model = {"vllm_version": "0.32.0", "model_runner": "v1"}
    cli, address = start_cli(
        out, "--max-samples", "1", "--expect-layers", "0,1", "--expect-model", "org/tiny",
        "--expect-dtype", "float32", "--expect-hidden-size", "32",
    )  # fmt: skip
    other = send(address, [{"request_id": "o-1", "num_tokens": 5, "block_ids": [2]}], producer="other",
                 provenance={**model, "model": "/models/org/huge"})  # fmt: skip
    layers = send(address, [{"request_id": "l-1", "num_tokens": 5, "block_ids": [2]}], producer="layers",
                  provenance={**model, "model": "org/tiny"}, layer_ids=[1, 0])  # fmt: skip
    good = {"request_id": "g-1", "num_tokens": 20, "block_ids": [3, 4]}
    res = send(address, [good], producer="producer", provenance={**model, "model": "/models/org/tiny"})
    rc, err = stop_cli(cli)
    assert rc == 0 and res["rc"] == 0 and res["finished"] == ["g-1"], err[-3000:]
    assert other["rc"] == 1 and "model /models/org/huge, expected org/tiny" in other["failed"]["o-1"]
    assert layers["rc"] == 1 and "layer ids [1, 0], expected [0, 1]" in layers["failed"]["l-1"]
    assert sorted(os.listdir(out)) == [".delivered", ".tmp", "producer"]
    check_file(out / "producer" / "g-1.safetensors", good)
    takes = "taking only samples that are layers [0, 1], dtype float32, hidden size 32, of model org/tiny"
    assert takes in err
    assert "2 samples were refused for not being what --expect-* says" in err


def test_cli_expect_flags_with_bad_values_end_in_one_line_errors(tmp_path: Path) -> None:
    for flags, says in (
        (["--expect-layers", "1,x"], "--expect-layers: comma-separated integers"),
        (["--expect-layers", "1,1"], "repeat an id"),
        (["--expect-hidden-size", "0"], "--expect-*"),
    ):
        r = run_cli("--listen", "127.0.0.1:0", "--out", str(tmp_path / "o"), *flags)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and says in errors[0], (flags, r.stderr[-2000:])


def test_a_sample_whose_file_cannot_be_written_is_refused_alone(tmp_path: Path) -> None:
    """A file where a producer's directory should be: that producer's sample is refused
    to it with the reason (it fails by name, no restart loop), the other one is written."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "prod-x").write_text("in the way")
    s = {"request_id": "r-1", "num_tokens": 5, "block_ids": [1]}
    cli, address = start_cli(out, "--max-samples", "2")
    res_x = send(address, [s], producer="prod-x")
    res_y = send(address, [s], producer="prod-y")
    rc, err = stop_cli(cli)
    assert rc == 0, err[-3000:]
    assert res_x["rc"] == 1 and list(res_x["failed"]) == ["r-1"]
    why = res_x["failed"]["r-1"]
    assert (
        "rejected" in why
        and "cannot write its file prod-x/r-1.safetensors" in why
        and "Not a directory" in why
    )
    assert res_y["rc"] == 0 and res_y["finished"] == ["r-1"]
    check_file(out / "prod-y" / "r-1.safetensors", s, "prod-y")


def test_a_failing_disk_stops_the_cli_without_acking_and_loses_nothing(tmp_path: Path) -> None:
    """Writes past the file-size limit (RLIMIT_FSIZE) fail with EFBIG, a failure of the
    file system rather than of the sample, as a full disk's ENOSPC is: the CLI ends with
    one error line and exit code 1, acknowledges nothing, and the restarted CLI gets the
    producer's resend and writes it."""
    out = tmp_path / "out"
    layout = BlockLayout("LTH", 16, 2, 8192, "float32")  # blocks of 1 MiB
    big = {"request_id": "big-1", "num_tokens": 320, "block_ids": list(range(20))}  # 20 MiB of states

    def small_files() -> None:  # 16 MiB: UCX's own files fit (it needs more than 1 MiB)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))

    held = held_port()
    try:
        cli = subprocess.Popen(
            [*CLI, "--listen-fd", str(held.fileno()), "--out", str(out), "--max-samples", "1",
             "--pool-mib", "24"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(held.fileno(),),
            preexec_fn=small_files,
        )  # fmt: skip
        sender = start_sender(
            dict(address=address_of(held), layout=layout_dict(layout), num_cache_blocks=20, seed=9,
                 finite=True, samples=[big], connect_timeout_s=60, timeout_s=90)
        )  # fmt: skip
        rc, err = stop_cli(cli)
        assert rc == 1, err[-3000:]
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "File too large" in errors[0] and "not acknowledged" in errors[0], err
        assert "Traceback" not in err
        assert not list(out.rglob("*.safetensors")) and not os.listdir(out / ".tmp")
        cli = subprocess.Popen(
            [*CLI, "--listen-fd", str(held.fileno()), "--out", str(out), "--max-samples", "1",
             "--pool-mib", "24"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(held.fileno(),),
        )  # fmt: skip
        rc, err = stop_cli(cli, timeout=90)
        res = finish_sender(sender)
    finally:
        held.close()
    assert rc == 0, err[-3000:]
    assert res["rc"] == 0 and res["finished"] == ["big-1"], res["stderr"][-3000:]
    check_file(out / "producer" / "big-1.safetensors", big, layout=layout, cache_blocks=20)


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
