"""The node-local store of fetched rows (``files.keep``): rows come back exact and
verified, in speculators' own file layout; a damaged file is set aside and its row
fetched again; at the budget keeping stops and nothing kept goes; a process killed while
writing leaves no row behind, only its temporary folder, which the next store removes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kv_connector.files.fp8 import Fp8Scale
from kv_connector.files.keep import (
    DAMAGED_SUFFIX,
    MANIFEST,
    TMP_ROOT,
    KeepFolderMismatch,
    RowStore,
    claim_folder,
    file_of,
)

T, L, H = 37, 3, 64


def row(seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (T,), generator=g), torch.randn(T, L, H, generator=g).to(dtype)


def kept(store: RowStore, idx: int, seed: int) -> None:
    tokens, states = row(seed)
    assert store.put(idx, tokens, states, {"layer_ids": "1,2,4"})


def test_a_kept_row_comes_back_exact_and_speculators_reads_the_same_file(tmp_path: Path) -> None:
    store = RowStore(tmp_path / "keep")
    assert store.get(3) is None and store.stats.misses == 1
    kept(store, 3, seed=3)
    store.close()
    got = RowStore(tmp_path / "keep").get(3)
    tokens, states = row(3)
    assert got is not None and torch.equal(got["token_ids"], tokens)
    assert torch.equal(got["hidden_states"], states)
    # speculators' own file backend, in a process where speculators imports
    site = Path(os.environ.get("SPECULATORS_SITE") or Path(sys.prefix) / "speculators-site-packages")
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from hs_connectors.transfer import FileTransfer\n"
        "got = FileTransfer(Path(sys.argv[1])).get_cached(3)\n"
        "torch.save(got, sys.argv[2])\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "theirs.pt"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "keep"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = torch.load(out)
    assert torch.equal(theirs["hidden_states"], states) and torch.equal(theirs["token_ids"], tokens)
    assert not list((tmp_path / "keep").glob("**/*.tmp"))  # nothing temporary is left


def test_a_damaged_file_is_set_aside_and_its_row_is_missing(tmp_path: Path) -> None:
    store = RowStore(tmp_path)
    kept(store, 1, seed=1)
    kept(store, 2, seed=2)
    store.close()
    path = file_of(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one bit of the states
    path.write_bytes(bytes(data))
    file_of(tmp_path, 2).write_bytes(file_of(tmp_path, 2).read_bytes()[:100])  # truncated
    again = RowStore(tmp_path)
    assert again.get(1) is None and again.get(2) is None and again.stats.damaged == 2
    assert path.with_name(path.name + DAMAGED_SUFFIX).exists() and not path.exists()
    kept(again, 1, seed=1)  # fetched again, kept again
    again.close()
    assert RowStore(tmp_path).get(1) is not None


def test_at_the_budget_keeping_stops_and_nothing_kept_goes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    one = T * L * H * 2 + T * 8
    store = RowStore(tmp_path, budget_bytes=2 * one + 10)
    for i in range(4):
        kept(store, i, seed=i)
    store.close()
    assert store.stats.kept == 2 and store.stats.over_budget >= 1
    assert [store.get(i) is not None for i in range(4)] == [True, True, False, False]
    assert sum("reached its budget" in r.getMessage() for r in caplog.records) == 1
    assert not store.put(9, *row(9), {})  # refused at once from now on


def test_fp8_rows_come_back_close_and_speculators_fp8_layout(tmp_path: Path) -> None:
    store = RowStore(tmp_path, fp8=Fp8Scale.TOKEN)
    kept(store, 5, seed=5)
    store.close()
    got = store.get(5)
    _, states = row(5)
    assert got is not None and got["hidden_states"].dtype == torch.bfloat16
    err = float((got["hidden_states"].float() - states.float()).norm() / states.float().norm())
    assert 0 < err < 0.05, err
    assert os.path.getsize(file_of(tmp_path, 5)) < T * L * H * 2  # one byte a value and the scales


def test_a_process_killed_while_writing_leaves_no_row_and_its_folder_is_cleared(tmp_path: Path) -> None:
    code = (
        "import os, sys, torch\n"
        "from pathlib import Path\n"
        "import kv_connector.files.safetensors_io as io\n"
        "from kv_connector.files.keep import RowStore\n"
        "real = io.write_safetensors\n"
        "def dying(path, tensors, meta, fsync=os.fsync):\n"
        "    Path(path).write_bytes(b'partial')\n"
        "    os._exit(9)\n"
        "io.write_safetensors = dying\n"
        "s = RowStore(sys.argv[1])\n"
        "s.put(7, torch.zeros(4, dtype=torch.int64), torch.ones(4, 2, 8), {})\n"
        "s.close()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert not file_of(tmp_path, 7).exists()
    assert any((tmp_path / TMP_ROOT).iterdir())  # its partial file, in its own folder
    store = RowStore(tmp_path)
    assert store.get(7) is None
    assert [d.name for d in (tmp_path / TMP_ROOT).iterdir()] == [store.tmp.name]


def test_a_full_disk_stops_keeping_with_a_warning_and_nothing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import errno

    import kv_connector.files.keep as keep

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    store = RowStore(tmp_path)
    kept(store, 0, seed=0)
    store.close()
    monkeypatch.setattr(keep, "write_atomically", full)
    kept(store, 1, seed=1)  # put never raises: the writer thread meets the full disk
    store.close()
    assert store.stats.write_errors == 1 and not store.put(2, *row(2), {})
    assert any("keeping stops, training goes on" in r.getMessage() for r in caplog.records)
    assert store.get(0) is not None and store.get(1) is None  # what was kept stays


def test_two_stores_sharing_a_folder_keep_whole_rows(tmp_path: Path) -> None:
    """Two runs keeping the same rows at once: every file is whole and verified (the last
    rename wins, and both wrote the same row)."""
    a, b = RowStore(tmp_path), RowStore(tmp_path)
    for i in range(12):
        kept(a, i, seed=i)
        kept(b, i, seed=i)
    a.close()
    b.close()
    check = RowStore(tmp_path)
    for i in range(12):
        got = check.get(i)
        assert got is not None and torch.equal(got["hidden_states"], row(i)[1])
    assert check.stats.damaged == 0


WRITER = """
import sys, torch
from kv_connector.files.keep import RowStore, claim_folder
root, first, rows, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
claim_folder(root, {"layout": "safetensors", "layer_ids": "1,2,4"})
s = RowStore(root)
for k in range(rows):
    i = (first + k) % rows  # both runs keep every row, from different starts
    g = torch.Generator().manual_seed(i)
    s.put(i, torch.arange(size, dtype=torch.int64) + i, torch.randn(size, 3, 64, generator=g), {})
    while s.queued > 2:  # keep each row, not MAX_QUEUED at once
        __import__("time").sleep(0.001)
s.close()
print(s.stats.kept)
"""


def writer_row(i: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.arange(size, dtype=torch.int64) + i, torch.randn(size, 3, 64, generator=g)


def test_two_runs_sharing_a_folder_keep_whole_verified_rows(tmp_path: Path) -> None:
    """Two processes keep the same rows into one folder at once while this one reads it:
    every read is a whole verified row or a miss, never a damaged one, and in the end
    every row is there, exact."""
    rows, size = 24, 2048
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(first), str(rows), str(size)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for first in (0, rows // 2)
    ]
    reader = RowStore(tmp_path)
    while any(p.poll() is None for p in procs):
        for i in range(rows):
            got = reader.get(i)
            assert got is None or torch.equal(got["hidden_states"], writer_row(i, size)[1]), i
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and all(int(o) >= 1 for o in outs), outs
    assert reader.stats.damaged == 0 and reader.stats.hits > 0
    for i in range(rows):
        got = reader.get(i)
        assert got is not None and torch.equal(got["token_ids"], writer_row(i, size)[0]), i
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(DAMAGED_SUFFIX)]


def test_a_run_that_would_keep_other_rows_is_refused(tmp_path: Path) -> None:
    """The folder names what it keeps once; a run of the same model and layers (or one
    that does not know them) shares it, one of another model, layers or layout is refused."""
    first = {"layout": "safetensors", "model": "m", "layer_ids": "1,2,4"}
    assert claim_folder(tmp_path, first) == first
    assert claim_folder(tmp_path, dict(first)) == first
    assert claim_folder(tmp_path, {"layout": "safetensors"}) == first  # knows less: shares it
    for other in ({"layer_ids": "1,2,3"}, {"model": "n"}, {"layout": "fp8-token"}):
        with pytest.raises(KeepFolderMismatch, match="give this run a folder of its own"):
            claim_folder(tmp_path, {**first, **other})
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST]  # no temporary left


KILLED = """
import sys, torch
from kv_connector.files.keep import RowStore
s = RowStore(sys.argv[1])
print(s.tmp, flush=True)
i = 0
while True:  # rows of 48 MiB, one after another, until killed
    s.put(i, torch.arange(4096, dtype=torch.int64), torch.full((4096, 3, 2048), float(i)), {})
    while s.queued > 0:
        __import__("time").sleep(0.001)
    i += 1
"""


def test_a_writer_killed_mid_write_leaves_only_whole_rows_and_the_restart_refetches(tmp_path: Path) -> None:
    """A process keeping rows is killed (SIGKILL) while a row's temporary file is being
    written: every row file left verifies, the torn one is under no row's name, the next
    store clears the dead process's folder, and the row not kept is a miss, so it is
    fetched and kept again."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        tmp = Path(proc.stdout.readline().strip())
        deadline = time.monotonic() + 120
        while not (list(tmp.glob("*.tmp")) and list(tmp_path.glob("hs_*.safetensors"))):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.0005)
        time.sleep(0.005)  # into the row's bytes
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    # whatever it was writing is under its temporary name only: no row file is torn
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".hs.*"))
    kept_rows = sorted(int(p.stem.split("_")[1]) for p in tmp_path.glob("hs_*.safetensors"))
    restart = RowStore(tmp_path)
    assert not tmp.exists()  # the dead writer's folder is gone
    for i in kept_rows:
        got = restart.get(i)
        assert got is not None and bool((got["hidden_states"] == float(i)).all()), i
    nxt = max(kept_rows) + 1  # the row being written when it died: not kept, so fetched again
    assert restart.get(nxt) is None and restart.stats.damaged == 0
    states = torch.full((4096, 3, 2048), float(nxt))
    assert restart.put(nxt, torch.arange(4096, dtype=torch.int64), states, {})
    restart.close()
    got = RowStore(tmp_path).get(nxt)
    assert got is not None and bool((got["hidden_states"] == float(nxt)).all())


@pytest.mark.parametrize("fp8", [None, Fp8Scale.TOKEN, Fp8Scale.LAYER])
def test_a_row_with_more_layers_is_read_for_the_layer_ids_asked_by_id(
    tmp_path: Path, fp8: Fp8Scale | None
) -> None:
    """A row kept with layers 1, 2, 4 read for [4, 1] gives layers 4 then 1 (by id, not
    position), equal to a full read's; a layer's damaged bytes do not stop a read of the
    others (they are not read) but a read that needs them finds the damage; an id the row
    lacks is a miss."""
    store = RowStore(tmp_path, fp8=fp8)
    kept(store, 1, seed=1)
    kept(store, 2, seed=2)
    store.close()
    whole = RowStore(tmp_path, fp8=fp8).get(1)
    some = RowStore(tmp_path, fp8=fp8).get(1, [4, 1])
    assert whole is not None and some is not None
    assert torch.equal(some["token_ids"], whole["token_ids"])
    assert torch.equal(some["hidden_states"], whole["hidden_states"][:, [2, 0]])
    same = RowStore(tmp_path, fp8=fp8).get(1, [1, 2, 4])
    assert same is not None and torch.equal(same["hidden_states"], whole["hidden_states"])
    missing = RowStore(tmp_path, fp8=fp8)
    assert missing.get(1, [3]) is None and missing.stats.misses == 1 and missing.stats.damaged == 0
    # damage layer 2 (position 1) of the last token: the file's last tensor is hidden_states
    # (names in order: hidden_states, [scales,] token_ids), so find its bytes by its header
    import struct

    raw = bytearray(file_of(tmp_path, 2).read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, _end = json.loads(raw[8 : 8 + n])["hidden_states"]["data_offsets"]
    width = H * (1 if fp8 is not None else 2)
    at = 8 + n + begin + ((T - 1) * L + 1) * width + 3  # token T-1, position 1, a byte in
    raw[at] ^= 0x10
    file_of(tmp_path, 2).write_bytes(bytes(raw))
    other = RowStore(tmp_path, fp8=fp8)
    got = other.get(2, [1, 4])
    assert got is not None and other.stats.damaged == 0  # layer 2's bytes were not needed
    want = row(2)[1][:, [0, 2]]
    if fp8 is None:
        assert torch.equal(got["hidden_states"], want)
    assert other.get(2, [2]) is None and other.stats.damaged == 1  # set aside


def test_a_run_of_some_of_the_folders_layers_shares_it() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        claim_folder(d, {"layout": "safetensors", "layer_ids": "1,2,4"})
        assert claim_folder(d, {"layout": "safetensors", "layer_ids": "4,1"})["layer_ids"] == "1,2,4"
        with pytest.raises(KeepFolderMismatch):
            claim_folder(d, {"layout": "safetensors", "layer_ids": "1,3"})


DRAFTER = """
import json, sys, torch
from kv_connector.speculators import KvHiddenStatesTransfer
t = KvHiddenStatesTransfer(mode="worker", keep=sys.argv[1], expect={"layer_ids": [1, 4]})
got = t.get_cached(1)
none = t.get_cached(5)
torch.save(got, sys.argv[2])
print(json.dumps({"missed": t.missed, "none": none is None, "keeps": t.keeps}))
"""


def test_speculators_backend_reads_a_drafters_layers_of_rows_kept_with_more(tmp_path: Path) -> None:
    """Our speculators backend over a folder kept with layers 1, 2, 4, for a drafter that
    expects 1 and 4: each row comes back with those two layers, found by id; the run does
    not keep rows into that folder (its fetched rows would hold fewer layers)."""
    keep = tmp_path / "keep"
    claim_folder(keep, {"layout": "safetensors", "layer_ids": "1,2,4"})
    store = RowStore(keep)
    kept(store, 1, seed=1)
    store.close()
    site = Path(os.environ.get("SPECULATORS_SITE") or Path(sys.prefix) / "speculators-site-packages")
    if not (site / "hs_connectors").is_dir():
        pytest.skip(f"speculators is not installed in {site}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "got.pt"
    proc = subprocess.run(
        [sys.executable, "-c", DRAFTER, str(keep), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.splitlines()[-1])
    assert said == {"missed": None, "none": True, "keeps": False}
    got = torch.load(out)
    assert torch.equal(got["hidden_states"], row(1)[1][:, [0, 2]])
    assert torch.equal(got["token_ids"], row(1)[0])
