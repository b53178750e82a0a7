"""The GPU check's engine tier as far as a machine without a GPU takes it: its carry built
(xz at a fast preset: larger than the real one, so fitting here means fitting there) and
measured against the 64 MiB a GPU host accepts; the carried vLLM 0.33 imported in a Python
whose import hook admits only the GPU host's packages and the carry; every carried
wheel's requirements met; every ``LLM`` option the tier passes accepted by vLLM 0.33's
own ``EngineArgs`` and config; the stand-in for vLLM's compiled kernels; and the tier's
refusal without CUDA. tests/e2e/test_engine_tier_rehearsal.py runs its stages' own code
on vLLM's CPU build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from scripts.gpu import carry as device_carry
from scripts.gpu import cuda_rehearsal, engine_carry, engine_tier

REPO = Path(__file__).resolve().parents[2]


def run_py(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


@pytest.fixture(scope="module")
def carry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine carry, built here from vLLM 0.33.0's wheel (fetched once, as ``make
    test-vllm033`` does; a failed fetch fails) and the package index."""
    out = tmp_path_factory.mktemp("engine-carry")
    engine_carry.build(out, preset=1)
    return out


@pytest.fixture(scope="module")
def carried_tree(carry: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("carried-vllm")
    engine_tier.unpack_tar(carry / engine_tier.VLLM_TAR, tree)
    return tree


def test_the_carry_is_built_and_fits_in_what_a_gpu_host_accepts(carry: Path) -> None:
    assert not engine_tier.carry_missing(carry)
    assert engine_carry.wheels_complete(carry / "wheels")
    carried = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    tree = sum(p.stat().st_size for p in device_carry.travelling_files(REPO))
    assert tree + carried <= device_carry.LIMIT_BYTES, (tree, carried)
    with tarfile.open(carry / engine_tier.VLLM_TAR) as tar:
        names = set(tar.getnames())
        stand_in = tar.extractfile("vllm/_C_stable_libtorch.py")
        assert stand_in is not None
        assert stand_in.read() == engine_tier.STAND_IN.read_bytes()
    # what a GPU host imports on the tier's path, and nothing compiled
    for must in ("vllm/__init__.py", "vllm/third_party/pynvml.py", "vllm/model_executor/models/config.py"):
        assert must in names
    assert "vllm-0.33.0.dist-info/METADATA" in names  # platform detection asks its version
    assert not [n for n in names if n.endswith(".so")]


def test_the_plan_prints_the_measure_file_by_file(carry: Path) -> None:
    proc = run_py(["-m", "scripts.gpu_check", "--tier", "engine", "--plan", "--carry", str(carry)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plan["fits"] and plan["limit_MiB"] == 64
    assert sum(plan["carry"].values()) == sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    assert len(plan["carry"]) == len(engine_carry.WHEELS) + 2


def test_every_carried_wheel_has_what_it_requires_on_the_host_or_in_the_carry(carry: Path) -> None:
    assert engine_carry.unmet_requirements(carry / "wheels") == {}


def test_the_carried_vllm_imports_in_a_python_with_only_the_gpu_hosts_packages(carried_tree: Path) -> None:
    wheels = [a for w in engine_carry.WHEELS for a in ("--wheel", w.split("==")[0])]
    proc = run_py(
        ["-m", "scripts.gpu.restricted_import", "--carried", str(carried_tree), *wheels],
        env={"VLLM_TARGET_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["failed"] == {}, found["failed"]
    carried = [m for m in found["vllm_modules"] if m.startswith(str(carried_tree.resolve()))]
    assert len(carried) == len(found["vllm_modules"]) > 500  # the carried tree, not the venv's vLLM


def rehearse_on_an_h100(
    carried_tree: Path, work: Path, stages: str, prelude: str = ""
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``scripts.gpu.cuda_rehearsal`` in the GPU host's restricted Python (``prelude`` run
    first, in the same process) and its JSON line."""
    wheels = [a for w in engine_carry.WHEELS for a in ("--wheel", w.split("==")[0])]
    argv = ["--carried", str(carried_tree), *wheels, "--work", str(work), "--stages", stages]
    code = f"{prelude}\nfrom scripts.gpu import cuda_rehearsal\ncuda_rehearsal.main({argv!r})"
    proc = run_py(["-c", code])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    return proc, json.loads(lines[-1])


def test_on_a_capability_9_gpu_vllm_builds_what_the_tier_asks_and_every_op_on_its_path_is_defined(
    carried_tree: Path, tmp_path: Path
) -> None:
    """vLLM 0.33's own CUDA platform at capability 9.0 builds each engine stage's config
    from every option the tier passes, and its model (on the meta device): the backends it
    picks are the ones the tier asked for and the stand-ins provide, and no op the chosen
    code calls is missing."""
    proc, out = rehearse_on_an_h100(carried_tree, tmp_path, ",".join(cuda_rehearsal.STAGES))
    assert proc.returncode == 0 and out["ok"], json.dumps(out)[-4000:]
    assert out["platform"]["is_cuda"] and out["platform"]["capability"] == [9, 0]
    stages = out["stages"]
    assert list(stages) == list(cuda_rehearsal.STAGES)
    for name, stage in stages.items():
        assert stage["unmet"] == {} and stage["unknown_keys"] == [], name
        config = stage["config"]
        # every option the tier passes, as vLLM took it
        assert config["attention_backend"] == "TRITON_ATTN" and config["custom_ops"] == ["none"]
        assert config["rms_norm_priority"][0] == "native"
        assert config["method"] == "extract_hidden_states" and config["connector"] == "HiddenStatesConnector"
        # what cuts a cold start: the cache's size given, no JIT warm-up, few graphs
        assert config["kv_cache_memory_bytes"] == engine_tier.KV_CACHE_BYTES and config["jit_warmup"] is False
        assert config["async_scheduling"] is True  # Model Runner V2's default, as the tier runs it
        assert stage["config"]["model_runner_v2"] is True, name
        assert stage["attention"] == ["TRITON_ATTN"], name
        assert stage["drafter"]["model"] == "ExtractHiddenStatesModel"
        assert stage["drafter"]["attention"] == ["CACHE_ONLY_ATTN"]
        assert (
            stage["dispatch"]["RMSNormGated" if name.startswith("hybrid") else "RMSNorm"] == "forward_native"
        )
    assert stages["eager"]["config"]["cudagraph_mode"] == "NONE"
    for name in ("engine", "hybrid", "hybrid_prefix"):
        assert stages[name]["config"]["capture_sizes"] == engine_tier.CAPTURE_SIZES
        assert stages[name]["config"]["cudagraph_mode"] != "NONE"
        assert "NoOpEliminationPass" in stages[name]["post_grad_passes"]
    for name in ("hybrid", "hybrid_prefix"):
        hybrid = stages[name]
        assert hybrid["moe"]["backend"] == "TRITON"
        assert hybrid["moe"]["experts"].endswith("TritonExperts")
        assert hybrid["moe"]["router"].endswith("FusedTopKRouter")
        assert hybrid["gdn"]["prefill"] == "triton"  # FlashInfer is what vLLM picks unasked
        # the MoE's ops found on the path, each computed by the stand-in
        for op in ("_moe_C.topk_softmax", "_moe_C.moe_align_block_size", "_moe_C.moe_sum"):
            assert hybrid["ops"][op] == "native", (name, op)
    # the hybrid model's gated delta net prefill on Triton; prefix caching off, then on
    hybrid, hybrid_prefix = stages["hybrid"]["config"], stages["hybrid_prefix"]["config"]
    assert (
        hybrid["additional_config"] == hybrid_prefix["additional_config"] == {"gdn_prefill_backend": "triton"}
    )
    assert hybrid["prefix_caching"] is False and hybrid["mamba_cache_mode"] == "none"
    assert hybrid_prefix["prefix_caching"] is True and hybrid_prefix["mamba_cache_mode"] == "align"
    engine, pull = stages["engine"]["config"], stages["pull"]["config"]
    assert engine["additional_config"] == {}
    assert stages["engine"]["moe"] is None and stages["engine"]["gdn"] is None
    assert engine["connector_extra"] == {"consumer_address": "127.0.0.1:1"} and not engine["eager"]
    assert pull["connector_extra"] == {"delivery": "pull"}
    assert stages["eager"]["config"]["eager"]
    # each model in its own dtype, its own layers captured
    assert engine["dtype"] == "torch.float32" and engine["layer_ids"] == list(engine_tier.DENSE.layer_ids)
    assert hybrid["dtype"] == "torch.bfloat16" and hybrid["layer_ids"] == list(engine_tier.HYBRID.layer_ids)


UNPREPARED = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm._moe_C_stable_libtorch":
            raise ImportError(name)  # as on a GPU host with neither the module nor its stand-in
sys.meta_path.insert(0, Absent())
from scripts.gpu import engine_tier
asked = engine_tier.llm_kwargs
def unasked(*args, **kwargs):  # the tier's arguments without its choice of GDN prefill
    kw = asked(*args, **kwargs)
    kw.pop("additional_config", None)
    return kw
engine_tier.llm_kwargs = unasked
import os
os.environ[engine_tier.NO_ASYNC_SCHEDULING] = "1"  # what --no-async-scheduling sets
"""


def test_the_rehearsal_fails_on_the_hybrid_models_predicted_failures_naming_each(
    carried_tree: Path, tmp_path: Path
) -> None:
    """Without the MoE stand-in, and without the tier's choice of GDN prefill: the MoE
    ops the hybrid model calls are missing, and vLLM picks FlashInfer on capability 9.0,
    which the GPU host does not have. (With ``--no-async-scheduling``'s setting too.)"""
    proc, out = rehearse_on_an_h100(carried_tree, tmp_path, "hybrid", prelude=UNPREPARED)
    assert proc.returncode == 1 and not out["ok"]
    hybrid = out["stages"]["hybrid"]
    unmet = hybrid["unmet"]
    for op in ("_moe_C.topk_softmax", "_moe_C.moe_align_block_size", "_moe_C.moe_sum"):
        assert unmet[op]["state"] == "missing", op
    assert any("FusedTopKRouter" in place for place in unmet["_moe_C.topk_softmax"]["from"])
    assert hybrid["gdn"]["prefill"] == "flashinfer"
    assert unmet["package flashinfer"]["from"] == ["gdn: flashinfer"]
    # and --no-async-scheduling's setting reaches vLLM's config (on by default: the other test)
    assert hybrid["config"]["async_scheduling"] is False


STAND_IN_CHECK = r"""
import json
import torch
from scripts.gpu import stand_in_kernels as s

x = torch.randn(5, 16, dtype=torch.float32)
w = torch.randn(16)
r = torch.empty(5, 8)
torch.ops._C.silu_and_mul(r, x)
ok = {"silu_and_mul": torch.allclose(r, torch.nn.functional.silu(x[:, :8]) * x[:, 8:])}
o = torch.empty_like(x)
torch.ops._C.rms_norm(o, x, w, 1e-6)
ref = torch.nn.functional.rms_norm(x, (16,), w, 1e-6)
ok["rms_norm"] = torch.allclose(o, ref, atol=1e-5)
xi, res = x.clone(), torch.randn(5, 16)
ri = res.clone()
torch.ops._C.fused_add_rms_norm(xi, ri, w, 1e-6)
ok["fused_add_rms_norm"] = torch.allclose(ri, x + res) and torch.allclose(
    xi, torch.nn.functional.rms_norm(x + res, (16,), w, 1e-6), atol=1e-5
)
try:
    torch.ops._C.silu_and_mul_quant(r, x, w)
    ok["named_only_refuses"] = False
except NotImplementedError as e:
    ok["named_only_refuses"] = "silu_and_mul_quant" in str(e)
ok["capability_queries_say_no"] = not any(getattr(torch.ops._C, n)(90) for n in s.UNSUPPORTED)
print(json.dumps({"defined": s.DEFINED, "failed": s.FAILED, "named_only": list(s.NAMED_ONLY),
                  "unsupported": list(s.UNSUPPORTED), "ok": ok}))
"""


def test_the_stand_in_defines_the_ops_vllm_binds_and_computes_them_natively() -> None:
    # a process of its own: the venv's vLLM CPU build (imported by other tests) has a real _C
    proc = run_py(["-c", STAND_IN_CHECK])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failed"] == {}
    native = {
        "weak_ref_tensor",
        "get_cuda_view_from_cpu_tensor",
        "silu_and_mul",
        "rms_norm",
        "fused_add_rms_norm",
    }
    assert native | set(out["named_only"]) | set(out["unsupported"]) == set(out["defined"])
    assert all(out["ok"].values()), out["ok"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run the tier itself")
def test_without_cuda_the_engine_tier_refuses_at_once_in_one_line() -> None:
    proc = run_py(["-m", "scripts.gpu_check", "--tier", "engine"], timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == ""  # no JSON line: nothing ran
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "gpu_check --tier engine needs a CUDA GPU" in proc.stderr


def test_an_unknown_stage_is_refused_by_name() -> None:
    proc = run_py(["-m", "scripts.gpu_check", "--tier", "engine", "--only", "import,warp"], timeout=120)
    assert proc.returncode != 0
    assert "unknown stage 'warp'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_stages_run_in_the_order_that_gets_a_first_sample_soonest() -> None:
    """eager first (the shortest way to a sample, and it compiles the Triton kernels engine
    then reuses), v1 only when engine failed, gpu_pool, pull and speed only when it passed,
    the hybrid model after the dense one, prefix caching on only after a hybrid sample with
    it off; the GPU host's calls, each under its 10-minute command."""
    skip = engine_tier.skip_reason
    imported: dict[str, dict[str, Any]] = {"import": {"ok": True, "vllm_version": "0.33.0"}}
    passed = {**imported, "engine": {"ok": True}}
    failed = {**imported, "engine": {"ok": False}}
    assert engine_tier.STAGES[:4] == ["import", "eager", "engine", "v1"]
    assert engine_tier.STAGES.index("hybrid") < engine_tier.STAGES.index("hybrid_prefix")
    assert skip("eager", imported, 300) is None and skip("engine", imported, 300) is None
    assert skip("v1", passed, 300) and skip("v1", failed, 300) is None
    assert skip("gpu_pool", passed, 300) is None and skip("pull", passed, 300) is None
    assert skip("gpu_pool", failed, 300) and skip("pull", failed, 300)
    assert skip("speed", failed, 300) and skip("speed", passed, 300) is None
    assert skip("hybrid", failed, 300) is None  # its own model: it says something even then
    assert skip("hybrid_prefix", {**imported, "hybrid": {"ok": False}}, 300)
    assert skip("hybrid_prefix", {**imported, "hybrid": {"ok": True}}, 300) is None
    assert skip("pull", passed, engine_tier.MIN_STAGE_S - 1)  # no time for an optional stage
    assert skip("engine", {"import": {"ok": False}}, 300) == "import vllm failed"
    # every stage in one of the plan's calls, in the tier's order; each call under 10 minutes
    # with its set-up, the first two within a 15-minute lease with the machine's start
    assert [n for call, _ in engine_tier.PLAN for n in call] == engine_tier.STAGES
    assert all(total + 60 <= 600 for _, total in engine_tier.PLAN) and engine_tier.TOTAL_S + 60 <= 600
    assert sum(total + 20 for _, total in engine_tier.PLAN[:2]) <= 15 * 60 - 120


def test_the_unpacked_carry_declares_our_plugins_as_an_installed_package_would(tmp_path: Path) -> None:
    """The repository travels as a folder: vLLM finds our plugins only through the entry
    points that ``declare_plugins`` writes, the ones ``pyproject.toml`` names."""
    from importlib.metadata import distributions

    names = engine_tier.declare_plugins(tmp_path)
    assert names == ["hybrid_supplementary", "kv_connector_amx"]
    found = {
        ep.name: ep.value
        for d in distributions(path=[str(tmp_path)])
        for ep in d.entry_points
        if ep.group == "vllm.general_plugins"
    }
    assert found == {
        "hybrid_supplementary": "hybrid.plugin:register",
        "kv_connector_amx": "kv_connector.vllm_plugin:register",
    }


def test_the_tier_reads_the_host_syncs_the_connector_logs(caplog: pytest.LogCaptureFixture) -> None:
    """``syncs_from_log`` against the lines ``SyncWatch`` itself writes (a GPU raises the
    warnings; here the hook raises torch's words)."""
    import logging
    import warnings

    from kv_connector.producer.sync_watch import SyncWatch

    assert engine_tier.syncs_from_log("no such lines") == {"counted": False, "in_hooks": {}}
    with caplog.at_level(logging.INFO, logger="kv_connector.producer"):
        watch = SyncWatch(lambda: 0, set_mode=lambda mode: None)
        for syncs in (1, 2):
            with watch.hook("wait_for_save"):
                for _ in range(syncs):
                    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        with watch.hook("save_kv_layer"):
            pass
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert engine_tier.syncs_from_log(log) == {"counted": True, "in_hooks": {"wait_for_save": 3}}
