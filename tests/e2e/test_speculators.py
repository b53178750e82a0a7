"""The trainer's real client end to end: speculators 0.9.0 trains on what our pipeline wrote.

A tiny bf16 Llama behind vLLM's OpenAI server with HiddenStatesConnector; a ``datasets``
directory written as speculators' ``prepare_data`` writes it; the driver
(``python -m kv_connector.datagen``) sends every row; the reader CLI with ``--layout
speculators`` writes ``hidden_states/hs_<row>.safetensors``. Then speculators' own
``ArrowDataset`` with ``hs_connectors.FileTransfer`` loads every row (``on_missing="raise"``),
its own file checks pass, and what it hands to training equals the transformers model's
states within bf16 tolerance: the auxiliary layers, and as the verifier's last hidden
state the final layer's output before the norm (layer id 4 of 4).

The driver starts before the reader: its first requests wait for a reader that is not
there, fail after ``connect_timeout_s`` and are sent again, so the run also shows the
driver's retries end in every row delivered, once; run again with ``--skip-existing``
(and the rows as JSON lines) it sends nothing.

speculators and its imports live in ``.venv/speculators-site-packages`` (installed by
scripts/setup_env.sh without CUDA builds; ``SPECULATORS_SITE`` names another place); only
the processes that need them get it on their path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.e2e.api_server import ApiServer, tail
from tests.e2e.common import HIDDEN, LAYER_IDS, SPEC_MAIN, speculators_site
from tests.e2e.conftest import REPO, Reference, prompts_of, relative_error
from tests.ports import address_of, held_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LENGTHS = [1, 7, 127, 128, 129, 300, 45, 600, 2, 64, 999, 33]
CONNECT_TIMEOUT_S = 5  # the producer's wait for a reader, after which a row fails (and is retried)
READER_LATE_S = CONNECT_TIMEOUT_S + 2.0  # the reader starts this long after the first rows were served
# the driver's wait for a row's file before it sends the row again: the rows the reader
# missed are resent after it (the default, 120 s, would be most of the test's time); a
# row delivered late would be sent twice, so it stays well above a row's time here
CONFIRM_TIMEOUT_S = 30
TOLERANCE = 0.02  # relative error per sample, bf16 against the fp32 reference


def _wait_for_line(log: Path, text: str, timeout_s: float) -> None:
    """Until ``text`` appears in the server's log (a row was served)."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in the server's log within {timeout_s:.0f} s:\n{tail(log)}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tiny_llama_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scripts.support.make_tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-llama-bf16", "llama", seed=0, dtype="bfloat16"
    )


@pytest.mark.fresh_engine("a bf16 server whose reader starts late")
def test_speculators_loads_every_row_the_driver_and_the_reader_cli_produced(
    tiny_llama_bf16: Path, tmp_path: Path
) -> None:
    site = speculators_site()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(site)])}
    rows = prompts_of(LENGTHS, seed=15)
    data, hs_dir = tmp_path / "data", tmp_path / "data" / "hidden_states"
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    subprocess.run(
        [sys.executable, str(SPEC_MAIN), "write", str(data), str(tmp_path / "rows.json")],
        env=env, check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    hs_dir.mkdir()
    held = held_port()  # the reader's port, refusing connections until the CLI takes it
    cli = driver = None
    try:
        with ApiServer(
            tiny_llama_bf16,
            {"consumer_address": address_of(held), "connect_timeout_s": CONNECT_TIMEOUT_S},
            LAYER_IDS,
            tmp_path,
            args=["--dtype", "bfloat16", "--block-size", "128"],
        ) as server:
            driver = subprocess.Popen(
                [sys.executable, "-m", "kv_connector.datagen", "--dataset", str(data),
                 "--server", server.http.url, "--concurrency", "4", "--check-dir", str(hs_dir),
                 "--retries", "6", "--confirm-timeout", str(CONFIRM_TIMEOUT_S), "--progress-s", "5",
                 "--audit-model", str(tiny_llama_bf16), "--audit-rate", "1"],  # every row's meaning
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
            )  # fmt: skip
            # late enough that the first rows' samples waited out the producer's
            # connect_timeout_s, however long the driver takes to start: they fail first
            _wait_for_line(server.log, "POST /v1/completions", timeout_s=300)
            time.sleep(READER_LATE_S)
            cli = subprocess.Popen(
                [sys.executable, "-m", "kv_connector.reader", "--listen-fd", str(held.fileno()),
                 "--out", str(hs_dir), "--layout", "speculators", "--max-samples", str(len(rows)),
                 "--pool-mib", "64"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(held.fileno(),),
                env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
            )  # fmt: skip
            out, err = driver.communicate(timeout=600)
            print(err[-3000:])
            assert driver.returncode == 0, f"{err[-4000:]}\n{tail(server.log)}"
            summary = json.loads(out.splitlines()[-1])
            _, cli_err = cli.communicate(timeout=120)  # closes its pipes (ResourceWarning otherwise)
            assert cli.returncode == 0, cli_err[-3000:]
            # run again on the same rows (as JSON lines): every row is there, nothing is sent
            jsonl = tmp_path / "rows.jsonl"
            jsonl.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
            again = subprocess.run(
                [sys.executable, "-m", "kv_connector.datagen", "--jsonl", str(jsonl),
                 "--server", server.http.url, "--skip-existing", str(hs_dir)],
                capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
            )  # fmt: skip
            assert again.returncode == 0, again.stderr[-3000:]
            resumed = json.loads(again.stdout.splitlines()[-1])
    finally:
        held.close()
        for p in (cli, driver):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    print("driver:", json.dumps(summary))
    n = len(rows)
    assert summary["delivered"] == n and summary["failed"] == 0 and summary["unconfirmed"] == 0
    assert summary["retries"] > 0  # the rows sent before the reader was up
    assert summary["tokens"] == sum(LENGTHS)
    # every row with a next token (all but the 1-token one) audited against vLLM's prompt_logprobs
    assert summary["audited"] == sum(n > 1 for n in LENGTHS) and summary["audit_failed"] == 0
    assert summary["audit_mean_error_max"] < 0.05
    assert resumed["rows"] == 0 and resumed["skipped"] == n and resumed["failed"] == 0
    assert sorted(os.listdir(hs_dir)) == sorted(
        [".delivered", ".tmp", *(f"hs_{i}.safetensors" for i in range(n))]
    )

    loaded_file = tmp_path / "loaded.safetensors"
    proc = subprocess.run(
        [sys.executable, str(SPEC_MAIN), "load", str(data), str(loaded_file)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report == {"rows": n, "existing": list(range(n)), "corrupt": {}, "unavailable": {}}

    loaded = load_file(str(loaded_file))
    ref = Reference(tiny_llama_bf16)
    worst = 0.0
    for i, tokens in enumerate(rows):
        t = len(tokens)
        want = ref.states(tokens, LAYER_IDS)  # [T, 3, H], fp32
        aux, last = loaded[f"{i}.hidden_states"], loaded[f"{i}.verifier_last_hidden_states"]
        assert loaded[f"{i}.input_ids"].tolist() == tokens
        assert aux.dtype == last.dtype == torch.bfloat16
        assert aux.shape == (t, 2 * HIDDEN) and last.shape == (t, HIDDEN)
        errs = (relative_error(aux.view(t, 2, HIDDEN), want[:, :2]), relative_error(last, want[:, 2]))
        assert max(errs) < TOLERANCE, (i, t, errs)
        worst = max(worst, *errs)
        with safe_open(str(hs_dir / f"hs_{i}.safetensors"), "pt") as f:
            meta = f.metadata()
        assert meta["sample_id"] == str(i) and meta["layer_ids"] == "1,2,4"
    print(f"worst relative error {worst:.2e}")
