"""The reader CLI's fp8 files (``--fp8``): samples sent over real NIXL are written in
speculators' fp8 layout, and speculators' own ``FP8Transfer`` reads every row back
within its tolerance; with one scale per token the fp8 bytes and scales are exactly
what speculators' own quantizer makes of the producer's states. The per-layer variant
is read the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kv_connector.wire.layout import BlockLayout
from tests.e2e.common import speculators_site
from tests.integration.common import (
    REPO,
    expected_states,
    finish_sender,
    layout_dict,
    make_cache,
    start_cli,
    start_sender,
    stop_cli,
)

pytestmark = pytest.mark.integration

LAYOUT = BlockLayout("TLH", 16, 4, 64, "bfloat16")
SAMPLES = [
    {"request_id": "cmpl-a", "num_tokens": 1, "block_ids": [3], "sample_id": "0"},
    {"request_id": "cmpl-b", "num_tokens": 17, "block_ids": [5, 1], "sample_id": "1"},
    {"request_id": "cmpl-c", "num_tokens": 70, "block_ids": [2, 9, 4, 11, 7], "sample_id": "2"},
]


@pytest.mark.parametrize("scale", ["token", "layer"])
def test_speculators_fp8transfer_reads_every_fp8_file(scale: str, tmp_path: Path) -> None:
    site = speculators_site()
    out = tmp_path / "hidden_states"
    cli, address = start_cli(out, "--layout", "speculators", "--fp8", scale, "--max-samples", "3")
    spec = dict(
        address=address, layout=layout_dict(LAYOUT), num_cache_blocks=16, seed=4, finite=True, samples=SAMPLES
    )
    res = finish_sender(start_sender(spec))
    rc, err = stop_cli(cli)
    assert rc == 0 and res["rc"] == 0 and not res["failed"], err[-3000:]
    cache = make_cache(LAYOUT, 16, 4, finite=True)
    originals = {
        f"{s['sample_id']}.hidden_states": expected_states(
            cache, LAYOUT, s["block_ids"], s["num_tokens"]
        ).contiguous()
        for s in SAMPLES
    }
    for s in SAMPLES:  # half of bf16's bytes, and the file says what it is
        path = out / f"hs_{s['sample_id']}.safetensors"
        with safe_open(str(path), "pt") as f:
            hs, meta = f.get_tensor("hidden_states"), f.metadata()
        assert hs.dtype == torch.float8_e4m3fn and hs.shape == (s["num_tokens"], 4, 64)
        assert (
            meta["fp8_scale"] == scale
            and meta["dtype"] == "bfloat16"
            and meta["request_id"] == s["request_id"]
        )
    save_file(originals, str(tmp_path / "orig.safetensors"))
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "e2e" / "speculators_main.py"),
            "fp8",
            str(out),
            str(tmp_path / "orig.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(site)])},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["rows"] == 3 and report["within_tolerance"] == [True] * 3
    if scale == "token":
        assert report["byte_exact"] == [True] * 3  # speculators' own quantizer's bytes
        assert report["scales"] == [[n, 1, 1] for n in (1, 17, 70)]
    else:
        assert report["scales"] == [[n, 4, 1] for n in (1, 17, 70)]
