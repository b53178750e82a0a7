"""The GPU check's device tier, run here on host tensors (``--device cpu``; its GPU pools
are the device-pool code on host memory): the same code the GPU host runs, with real
NIXL between processes, in a Python that cannot import vLLM, prometheus_client or
transformers (what the GPU host lacks), and the set of files that must travel there,
measured against the 64 MiB that may travel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
ABSENT_ON_THE_GPU_MACHINE = ("vllm", "prometheus_client", "transformers")

REFUSE = f"""
import sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_THE_GPU_MACHINE!r}:
            raise ImportError(name + " is not on the GPU machine")
        return None
sys.meta_path.insert(0, _Refuse())
"""


def test_the_device_tier_runs_on_host_tensors_without_vllm(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(REFUSE)  # every process of the tier loads it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    probe = subprocess.run([sys.executable, "-c", "import vllm"], env=env, capture_output=True, text=True)
    assert "is not on the GPU machine" in probe.stderr  # the refusal is in force
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_check", "--tier", "device", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout[-2000:]
    out = json.loads(lines[0])
    assert out["tier"] == "device" and out["ok"] is True
    assert out["device"].startswith("cpu")
    # a: bit for bit, both layouts x two dtypes x five lengths
    assert out["integrity"]["ok"] and out["integrity"]["cases_bit_exact"] == 20
    assert out["integrity"]["d2h_bytes_per_block"] == 8.0
    # b: the step path found the request written outside its table, and only it
    b = out["step_path"]
    assert b["ok"] and "the block table says" in b["wrong_slots_caught"]
    assert b["tokens_compared"] == 160  # a 102, b 22, c 2, d 34 positions read back
    assert set(b["ms_after_busy_launch"]) == {"forward_queued", "engine_done", "first_poll"}
    # c, and the same into pools on the device (here the host): push and pull each compared
    # every sample, timed both sides, and timed a sample from its finish to usable
    for name in ("nixl", "gpu_pool"):
        c = out[name]
        assert c["ok"], c
        for mode, raw, usable in (
            ("push", "raw_write_GBps", "finish_to_usable_ms_median"),
            ("pull", "raw_read_GBps", "fetch_to_usable_ms_median"),
        ):
            assert c[mode]["samples_compared"] == 5
            assert c[mode]["ours_GBps"] > 0 and c[mode][raw] > 0 and c[mode]["d"] > 0
            assert c[mode]["cache_mem"] == "DRAM" and c[mode]["pool_mem"] == "DRAM"
            assert c[mode]["sample_device"] == "cpu" and c[mode][usable] > 0
        # where a pushed sample's time went: both ends' stages, the integrity work among them
        stages = c["push"]["stages_ms_a_sample"]
        assert set(stages) == {
            "grant_wait_s_ms",
            "write_s_ms",
            "ack_wait_s_ms",
            "checksum_s_ms",
            "reader_verify_s_ms",
            "reader_values_check_s_ms",
        }, stages
        assert stages["write_s_ms"] > 0 and stages["reader_verify_s_ms"] > 0, stages
        # the values screen runs in verify, on what the fingerprint check reads: a host pool's
        # on the lines around its words, a device pool's on the share's whole rows in the same
        # pass; a clean sample's hand-out reads nothing more
        assert stages["reader_values_check_s_ms"] == 0, stages
        assert min(stages.values()) >= 0, stages
        # each pairing: GB/s against raw, the transports UCX picked for ours and for raw as the
        # package's agents read them, finish to usable
        rows = {r["pairing"]: r for r in c["pairings"]}
        assert set(rows) == {"push: host cache -> host pool", "pull: host cache -> host pool"}, rows
        for r in rows.values():
            assert r["ours_GBps"] > 0 and r["raw_GBps"] > 0 and r["of_raw"] > 0, r
            assert r["transports"] and r["raw_transports"], r
            assert r["finish_to_usable_ms"] > 0, r
    assert out["gpu_pool"]["gpudirect"] == {"plan": "none"}  # a host device flushes nothing
    # push into a pool the reader offers to this node: compared, timed, its row names the
    # mapped path as the transport of ours and UCX's for raw
    m = out["node_pool"]
    assert m["ok"] and m["push"]["samples_compared"] == 5 and m["push"]["d"] > 0, m
    (row,) = m["pairings"]
    assert row["pairing"] == "push: host cache -> host pool (node_pool)", row
    assert row["transports"] == ["node_pool"] and row["raw_transports"], row
    assert "node_pool" not in row["raw_transports"] and row["finish_to_usable_ms"] > 0, row
    assert [(r["check"], r["pairing"][:4]) for r in out["pairings"]] == [
        ("nixl", "push"),
        ("nixl", "pull"),
        ("gpu_pool", "push"),
        ("gpu_pool", "pull"),
        ("node_pool", "push"),
    ], out["pairings"]
    # the agents ran with the package's UCX defaults, and UCX printed no table
    assert "RMA_PPLN_ENABLE=y" in out["ucx_settings"]["engine_config"], out["ucx_settings"]
    assert "ucx_tables" not in out["nixl"]
    assert out["nixl"]["ucx_warnings"] == [] and out["gpu_pool"]["ucx_warnings"] == []
    lines = [ln for ln in proc.stderr.splitlines() if "GB/s, raw" in ln]
    assert len(lines) == 5 and all("of raw); over " in ln for ln in lines), proc.stderr[-2000:]


def test_the_carry_set_fits_what_the_device_tool_carries() -> None:
    """The wheels are fetched from the package index into .gpu-carry (once), then the
    repository as it travels plus the wheels is measured."""
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.gpu_check", "--tier", "device", "--plan"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout.splitlines()[-1])
    carry = plan["carry"]
    names = sorted(carry["wheels"])
    assert len(names) == 3
    assert names[0].startswith("msgspec-") and "cp312" in names[0] and "manylinux" in names[0]
    assert names[1].startswith("nixl-1.5.1-py3-none-any")
    assert names[2].startswith("nixl_cu13-1.5.1-cp312-cp312-manylinux")
    assert carry["wheels"][names[2]] > 40 << 20  # the real wheel, not a stub
    assert carry["repository_bytes"] > 500_000
    assert carry["total_bytes"] == carry["repository_bytes"] + sum(carry["wheels"].values())
    assert carry["fits"] is True and carry["total_bytes"] <= 64 << 20, carry
    assert carry["carry_dir"] == ".gpu-carry"
    assert "--python-version 3.12" in plan["fetch"]


def test_the_carried_wheels_unpack_where_pip_will_not_install_them() -> None:
    """Here pip refuses cp312 wheels (this Python is another), so ``install`` falls back to
    unpacking them: the folder then holds the three import names."""
    from scripts.gpu import carry

    if sys.version_info[:2] == (3, 12):
        pytest.skip("this Python is 3.12: pip installs the wheels, the fallback is not reached")
    carry.fetch()
    site = carry.install()
    assert (site / "nixl").is_dir() and (site / "nixl_cu13").is_dir() and (site / "msgspec").is_dir()
    assert not any(p.name.endswith(".data") for p in site.iterdir())
    assert not site.is_relative_to(REPO)  # it never travels with the working tree
