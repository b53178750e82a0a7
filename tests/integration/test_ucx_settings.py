"""What a real NIXL agent's UCX gets from us and tells us back: our UCX defaults reach
UCX's configuration (NIXL's own debug log says so), a user's ``UCX_*`` and the off switch
win, and the transport UCX picks for each pairing is read from the files UCX writes,
after real transfers, with nothing printed and nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# two agents of one process: a WRITE and a READ of 4 MiB in 1 MiB blocks between them
SCRIPT = """
import json, os, numpy as np, torch
from kv_connector.wire.nixl_transport import NixlTransport
from kv_connector.wire.ucx_choices import ucx_choices
from kv_connector.wire.ucx_report import Mem, Op
a, b = NixlTransport("ucx-settings-a"), NixlTransport("ucx-settings-b")
src = torch.arange(4 << 20, dtype=torch.int64).to(torch.uint8)
dst = torch.zeros(4 << 20, dtype=torch.uint8)
back = torch.zeros(4 << 20, dtype=torch.uint8)
ra, rb, rback = a.register(src), b.register(dst), a.register(back)
peer = a.add_peer(b.metadata)
b.add_peer(a.metadata)
spans = [(i << 20, i << 20, 1 << 20) for i in range(4)]
x = a.write(peer, ra, rb, spans, b"n")
while not a.poll(x):
    b.notifications()
rdma_before = a.rdma_into(Op.READ, Mem.HOST)  # no READ yet: not known
x = a.read(peer, rback, rb, spans)
while not a.poll(x):
    b.notifications()
assert torch.equal(src, dst) and torch.equal(src, back)
rdma = [rdma_before, a.rdma_into(Op.READ, Mem.HOST), a.rdma_into(Op.READ, Mem.GPU)]
report = a.report_dir if os.environ.get("SHOW_REPORT_DIR") else None
a.close()
b.close()
left = report and os.path.exists(report)
print("RESULT " + json.dumps({"choices": ucx_choices(), "report_left": left, "rdma": rdma}))
"""


def run(env: dict[str, str], script: str = SCRIPT) -> tuple[dict[str, object], str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT ")), proc.stdout, proc.stderr


NIXL_DEBUG = {"NIXL_LOG_LEVEL": "DEBUG"}


def test_our_defaults_reach_ucx_and_nothing_else_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("UCX_RMA_PPLN_ENABLE", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "KV_CONNECTOR_UCX_DEFAULTS"):
        monkeypatch.delenv(name, raising=False)
    _, _, err = run(NIXL_DEBUG)
    assert "Modified UCX config: RMA_PPLN_ENABLE=y" in err
    # on a host without CUDA UCX has no cuda_ipc transport, and refuses its setting quietly
    assert (
        "Modified UCX config: CUDA_IPC_ENABLE_GET_ZCOPY=y" in err
        or "Failed to modify UCX config: CUDA_IPC_ENABLE_GET_ZCOPY=y" in err
    )
    assert "unused environment variable" not in err  # nothing put in the environment


def test_a_users_value_and_the_off_switch_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KV_CONNECTOR_UCX_DEFAULTS", raising=False)
    _, _, err = run({**NIXL_DEBUG, "UCX_RMA_PPLN_ENABLE": "n"})
    assert "RMA_PPLN_ENABLE" not in err  # UCX reads the user's own from the environment
    assert "UCX config: CUDA_IPC_ENABLE_GET_ZCOPY=y" in err  # the other default stays
    _, _, err = run({**NIXL_DEBUG, "KV_CONNECTOR_UCX_DEFAULTS": "0"})
    assert "RMA_PPLN_ENABLE" not in err and "CUDA_IPC_ENABLE_GET_ZCOPY" not in err


def test_each_pairing_is_read_from_ucx_with_nothing_printed_nor_left(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("UCX_PROTO_INFO", "UCX_PROTO_INFO_DIR", "KV_CONNECTOR_UCX_REPORT", "UCX_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    got, out, err = run({"SHOW_REPORT_DIR": "1"})
    choices = got["choices"]
    assert isinstance(choices, dict)
    ours = choices["ucx-settings-a"]
    assert set(ours) == {
        "WRITE from host memory to host memory on this node",
        "READ into host memory from host memory on this node",
    }, ours
    assert all(ours.values()), ours  # the transports UCX named (cma/memory here)
    assert "ucx-settings-b" not in choices  # the target posted nothing
    assert "remote memory" not in out + err  # no table printed
    assert got["report_left"] is False  # the agent's report directory went with it
    # what a pull pool asks before it flushes: unknown before the first READ, then no RDMA
    # on loopback (shared memory or tcp); nothing known of READs into a GPU
    assert got["rdma"] == [None, False, None]


def test_without_the_report_nothing_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ({"KV_CONNECTOR_UCX_REPORT": "0"}, {"UCX_PROTO_INFO": "n"}):
        got, _, _ = run(env)
        assert got["choices"] == {}, env


def test_reports_of_processes_gone_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(gone.stdout)
    left = tmp_path / f"kvc-ucx-{pid}-abc"  # as a killed process leaves it
    left.mkdir()
    (left / "x_intra_node_cfg_1_put_from_host_memory_to_host_0_inf.dot").write_text("digraph {}\n")
    mine = tmp_path / f"kvc-ucx-{os.getpid()}-abc"  # a live process's: kept
    mine.mkdir()
    run({"TMPDIR": str(tmp_path)})
    assert not left.exists() and mine.exists()
    assert [p.name for p in tmp_path.iterdir()] == [mine.name]  # the agents' own went with them


# a description as UCX writes it on a GPU host whose cuda_ipc serves no READ (an H200
# without NVLink under UCX's own defaults), put where the agent reads the user's directory
WARN = """
import logging, os, sys
from pathlib import Path
from kv_connector.wire.nixl_transport import NixlTransport
from kv_connector.wire.ucx_choices import ucx_choices
report = Path(os.environ["UCX_PROTO_INFO_DIR"])
name = "warn_agent_intra_node_cfg_2_get_multi_into_cuda_GPU0_from_cuda_dev_1_8157_inf.dot"
(report / name).write_text('digraph {\\n\\tnode0 [label="zero-copy\\\\ntcp/lo" shape=box]\\n}\\n')
t = NixlTransport("warn-agent")
new = t.report_choices()
t.close()
assert (report / name).exists()  # the user's directory is theirs
print("RESULT " + json.dumps({"new": [str(p) for p in new], "choices": ucx_choices()}))
"""


def test_tcp_under_a_gpu_buffer_is_warned_with_the_setting(tmp_path: Path) -> None:
    got, _, err = run({"UCX_PROTO_INFO_DIR": str(tmp_path), "UCX_PROTO_INFO": "n"}, "import json\n" + WARN)
    assert got["new"] == ["READ into GPU from GPU on this node"]
    (warning,) = [ln for ln in err.splitlines() if "a GPU buffer over TCP" in ln]
    assert "warn-agent" in warning and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in warning
