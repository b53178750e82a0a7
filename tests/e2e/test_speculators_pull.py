"""speculators 0.9.0 trains online from our producer in pull delivery, end to end: vLLM's
OpenAI server (CPU build) with ``"delivery": "pull"``, speculators' own
``create_train_val_loaders(..., on_missing="generate", num_workers=2)`` with our backend
("kv-hidden-states", ``kv_connector.speculators``) over a dataset in speculators' format,
three epochs with the rows kept on the node (``--kv-hs-keep``). Every row's tokens are
exact and its states equal the transformers model's; nothing is written to the dataset;
vLLM computes each row once; afterwards the server's ``vllm:kv_cache_usage_perc`` is back
to 0 (every sample was released). The server is also asked directly: its response
carries the handle at the top of ``kv_transfer_params`` and the "ready" record."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kv_connector.reader import FetchError, PullClient
from kv_connector.wire.handle import PullHandle, decode_handle, make_nonce
from tests.e2e.api_server import ApiServer, tail
from tests.e2e.common import (
    HIDDEN,
    LAYER_IDS,
    PULL_MAIN,
    SPEC_MAIN,
    UDS_SITE,
    kv_cache_usage,
    log_since,
    requests_done,
    speculators_site,
)
from tests.e2e.conftest import REPO, Reference, prompts_of, relative_error

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LENGTHS = [1, 7, 127, 128, 129, 300, 45, 600]
SERVED = r"serves consumer agent (\S+) \(a (\d+) MiB pool\)"


def _released_soon(server: ApiServer) -> bool:
    """vLLM's cache holds no sample within a few engine steps (the last releases reach it)."""
    for _ in range(30):
        time.sleep(0.5)
        if kv_cache_usage(server) == 0.0:
            return True
    return False


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")}


def test_speculators_dataloader_trains_from_pulled_samples_and_keeps_them_for_later_epochs(
    pull_server: ApiServer,
    tiny_llama: Path,
    llama_reference: Reference,
    tmp_path: Path,
) -> None:
    """speculators' own trainer with two DataLoader workers and the rank's fetch agent (the
    default): one NIXL agent (one registered pool) serves the rank's workers, the producer
    serves one consumer agent besides this test's own client, and no worker maps NIXL's
    UCX plugin. With ``--kv-hs-keep DIR`` and speculators' own sampler, three epochs: the
    first fetches every train row from vLLM and keeps it, the next read every row from DIR
    (vLLM computes each row once), exactly the first epoch's, and speculators' file
    backend reads every row from DIR. Then the same trainer runs both loaders again with a
    client per worker (one worker, no keep): its own agent, each row again equal to the
    transformers model's. The rank-kept sampler on two ranks is
    ``tests/bench/test_pull_dataloader_arms.py``'s (the pull bench's keep arm)."""
    site = speculators_site()
    rows = prompts_of(LENGTHS, seed=31)
    data, keep = tmp_path / "data", tmp_path / "keep"
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(site)])}
    subprocess.run(
        [sys.executable, str(SPEC_MAIN), "write", str(data), str(tmp_path / "rows.json")],
        env=env, check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    before = files_under(data)
    out_file = tmp_path / "loaded.safetensors"
    server = pull_server
    log_from = server.log.stat().st_size  # what the server says from here on is this test's
    # the server's own answer, asked directly
    resp = server.http.post_json(
        "/v1/completions",
        {"model": str(tiny_llama), "prompt": rows[2], "max_tokens": 1, "temperature": 0},
    )
    params = resp["kv_transfer_params"]
    assert params["hidden_states"]["status"] == "ready" and decode_handle(params["handle"])
    h = decode_handle(params["handle"])
    with PullClient(secret=b"not the producer's") as stranger, pytest.raises(FetchError) as e:
        stranger.fetch(params)  # a consumer whose secret the producer does not share
    assert e.value.code == "auth"
    with PullClient() as client:
        own_agent = client.name
        with pytest.raises(FetchError) as e:
            client.fetch(PullHandle(h.producer_id, h.request_id, make_nonce(), h.endpoints).encode())
        assert e.value.code == "unknown"  # a forged handle: no data, and nothing freed
        direct = client.fetch(params)
        assert direct.token_ids.tolist() == rows[2]
        with pytest.raises(FetchError) as e:
            client.fetch(params)
        assert e.value.code == "released"

    done_before = requests_done(server)
    trainer = subprocess.Popen(
        [sys.executable, str(PULL_MAIN), str(data), "http://localhost/v1", str(out_file), "2", "rank"],
        env={**env, "PYTHONPATH": os.pathsep.join([str(UDS_SITE), str(REPO), str(site)]),
             "KV_TEST_OPENAI_UDS": str(server.socket_path), "KV_TEST_KEEP": str(keep), "KV_TEST_EPOCHS": "3",
             # the trainer expects the verifier's layers 1, 2 and its last (4): every row is checked
             "KV_TEST_VERIFIER": str(tiny_llama), "KV_TEST_THEN_WORKER": "1"},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert trainer.stdout is not None and trainer.stdin is not None
        line = trainer.stdout.readline()  # the rank's agent's phase, its report
        if not line:
            _, err = trainer.communicate(timeout=60)
            ended = f"the trainer ended ({trainer.returncode})"
            raise AssertionError(f"{ended}: {err[-5000:]}\n{tail(server.log)}")
        report = json.loads(line)
        prompts = requests_done(server) - done_before
        released = kv_cache_usage(server) == 0.0 or _released_soon(server)
        rank_log = log_since(server, log_from)
        worker_from = server.log.stat().st_size
        out, err = trainer.communicate("worker\n", timeout=600)  # then a client per worker
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate()
    assert trainer.returncode == 0, f"{err[-5000:]}\n{tail(server.log)}"
    by_worker = json.loads(out.splitlines()[-1])
    served = set(re.findall(SERVED, rank_log))
    assert report["rows"] == list(range(len(rows))) and report["errors"] == 0, report
    assert report["processes"] >= 2  # the workers were alive when counted
    agent = report["agent"]
    assert report["nixl_agent_pids"] == [agent["pid"]], report  # one process made a NIXL agent
    consumers = {name for name, _mib in served} - {own_agent}
    assert consumers == {agent["name"]} and (agent["name"], "16") in served  # one agent, one pool
    assert agent["registered_bytes"] == 16 << 20 and agent["leases_held"] == 0
    assert released
    assert files_under(data) == before  # nothing written to the dataset: no hidden_states directory
    # the keep: epoch 1 fetched the train rows, epoch 2 none, the validation rows once, at the end
    assert report["sampler"] == "MultipackDistributedBatchSamplerV2", report
    first, second, last = report["fetched_by_epoch"]
    assert 0 < first < len(rows) and second == first and last == len(rows) == agent["fetched"], report
    assert report["later_epochs_differ"] == 0 and report["rows_from_keep_files"] == len(rows), report
    assert prompts == len(rows), prompts  # vLLM computed each row once in three epochs
    assert sorted(p.name for p in keep.glob("hs_*.safetensors")) == sorted(
        f"hs_{i}.safetensors" for i in range(len(rows))
    )
    # a client per worker: each loader's one worker made the one agent the producer served it
    worker_consumers = {name for name, _ in re.findall(SERVED, log_since(server, worker_from))}
    assert by_worker["rows"] == list(range(len(rows))) and by_worker["errors"] == 0, by_worker
    assert 1 <= len(worker_consumers) == len(by_worker["nixl_agent_pids"]) <= 2, (worker_consumers, by_worker)
    assert kv_cache_usage(server) == 0.0 or _released_soon(server)
    assert files_under(data) == before
    by_worker_rows = load_file(str(out_file.with_suffix(".worker.safetensors")))
    loaded = load_file(str(out_file))  # the last epoch's train rows (from DIR) and the validation rows
    worst = 0.0
    for i, tokens in enumerate(rows):
        want = llama_reference.states(tokens, LAYER_IDS)  # [T, 3, H], fp32
        t = len(tokens)
        assert loaded[f"{i}.input_ids"].tolist() == tokens
        aux, last_states = loaded[f"{i}.hidden_states"], loaded[f"{i}.verifier_last_hidden_states"]
        assert aux.shape == (t, 2 * HIDDEN) and last_states.shape == (t, HIDDEN)
        errs = (relative_error(aux.view(t, 2, HIDDEN), want[:, :2]), relative_error(last_states, want[:, 2]))
        assert max(errs) < 1e-4, (i, t, errs)
        worst = max(worst, *errs)
        # the same row through the workers' own clients
        w_aux = by_worker_rows[f"{i}.hidden_states"]
        assert by_worker_rows[f"{i}.input_ids"].tolist() == tokens
        assert relative_error(w_aux.view(t, 2, HIDDEN), want[:, :2]) < 1e-4, i
        assert relative_error(by_worker_rows[f"{i}.verifier_last_hidden_states"], want[:, 2]) < 1e-4, i
    print(f"{len(rows)} rows through speculators' DataLoader, worst relative error {worst:.2e}")


BACKEND_CHECK = """
import argparse, json
import kv_connector.speculators as ks
import importlib; importlib.reload(ks); ks.register()  # imported and registered again: harmless
from hs_connectors.transfer import HiddenStatesBackend
b = HiddenStatesBackend.registry["kv-hidden-states"]
p = argparse.ArgumentParser(); b.add_launch_args(p); b.add_launch_args(p)
cfg = b.build_kv_transfer_config(p.parse_args(["--kv-hs-pull-timeout-s", "30"]))
from kv_connector.producer.options import ConnectorOptions
o = ConnectorOptions.parse(cfg["kv_connector_extra_config"])
t = b.from_train_args(argparse.Namespace(), "/nonexistent")
tp = argparse.ArgumentParser(); b.add_train_args(tp)
w = b.from_train_args(tp.parse_args(["--kv-hs-fetch-agent", "worker"]), "/nonexistent")
r = b.from_train_args(tp.parse_args(["--kv-hs-pool-mib", "64"]), "/nonexistent")
import pathlib, pickle, tempfile
v = pathlib.Path(tempfile.mkdtemp()); (v / "config.json").write_text(json.dumps({"num_hidden_layers": 32}))
e_given = ks.expectation_of(argparse.Namespace(verifier_name_or_path=str(v), target_layer_ids=[2, 16, 29]))
e_default = ks.expectation_of(argparse.Namespace(verifier_name_or_path=str(v)))
e_hub = ks.expectation_of(argparse.Namespace(verifier_name_or_path="meta-llama/Llama-3.1-8B"))
x = ks.KvHiddenStatesTransfer(mode="worker", expect=e_given)
x2 = pickle.loads(pickle.dumps(x))
print(json.dumps({"cfg": cfg, "pull": o.delivery.value == "pull", "timeout": o.pull.timeout_s,
                  "cached": t.get_cached(0), "names": sorted(HiddenStatesBackend.registry),
                  "modes": [t.mode.value, w.mode.value, r.mode.value],
                  "pools": [t.pool_mib, w.pool_mib, r.pool_mib], "started": t.agent is not None,
                  "expect": [e_given.layer_ids, e_default.layer_ids, e_hub.layer_ids, e_hub.model,
                             ks.expectation_of(argparse.Namespace()), x2.expect == e_given]}))
"""


@pytest.mark.e2e
def test_the_backend_registers_once_builds_the_producers_config_and_runs_speculators_cli() -> None:
    site = speculators_site()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(site)])}
    proc = subprocess.run(
        [sys.executable, "-c", BACKEND_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["pull"] and got["timeout"] == 30.0 and got["cached"] is None
    assert got["cfg"]["kv_connector"] == "HiddenStatesConnector" and got["cfg"]["kv_role"] == "kv_producer"
    assert got["names"] == ["file", "fp8", "kv-hidden-states", "mooncake"]
    # the rank's fetch agent by default (a 1 GiB pool for the rank), started only when needed
    assert got["modes"] == ["rank", "worker", "rank"] and got["pools"] == [1024, 256, 64]
    assert got["started"] is False
    # what the trainer expects of every row: the captured ids (the final layer appended, as
    # speculators' launcher does) where the verifier's config is on the node, and its name
    assert got["expect"] == [[2, 16, 29, 32], [2, 16, 29, 32], None, "meta-llama/Llama-3.1-8B", None, True]
    cli = subprocess.run(
        [sys.executable, "-m", "kv_connector.speculators", "train", "--help"],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "{file,fp8,mooncake,kv-hidden-states}" in cli.stdout and "--kv-hs-pool-mib" in cli.stdout
    assert "--kv-hs-fetch-agent" in cli.stdout
