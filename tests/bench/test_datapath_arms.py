"""``make bench``'s data-path arms run end to end (tiny sizes, real vLLM objects, a real
reader process, real NIXL): with XXH3 checksums, with block digests (a GPU cache's
default, here through the connector's options on CPU memory) and without, which a reader
accepts only when told to (by default it refuses unchecked shares from host caches). A broken arm fails
here instead of hanging the benchmark; the figures themselves are ``make bench``'s."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scripts.bench import datapath as bd

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOKENS = 3 * bd.BLOCK - 5  # a partly filled last block
N_REQ = 3


@pytest.mark.parametrize("checksum", ["auto", "xxh3", "blocks", "none"])
def test_the_data_path_arm_delivers_every_byte(
    tmp_path: Path, checksum: str, capfd: pytest.CaptureFixture[str]
) -> None:
    from scripts.support.vllm_harness import config_only_model

    model = config_only_model(tmp_path / "wide-llama", bd.HIDDEN, num_layers=4)
    nb = -(-TOKENS // bd.BLOCK)
    pool = 2 * nb * bd.BLOCK * len(bd.LAYERS) * bd.HIDDEN * 2
    try:
        m = bd.one_round("OursArm", model, N_REQ, TOKENS, 2 * nb + 1, pool, checksum, checksum == "xxh3")
    finally:
        shutil.rmtree(tmp_path / "wide-llama", ignore_errors=True)
    assert m["bytes"] == N_REQ * TOKENS * len(bd.LAYERS) * bd.HIDDEN * 2
    assert m["tokens"] == N_REQ * TOKENS
    assert m["seconds"] > 0
    assert m["cpu_s"] == pytest.approx(m["producer_cpu_s"] + m["reader_cpu_s"])
    assert m["producer_cpu_s"] > 0 and m["reader_cpu_s"] > 0
    assert m["reader_rss_mib"] >= m["reader_pool_mib"]
    assert 0 < m["post_s"] < m["seconds"]  # the writer's time inside its posts, this round
    assert (m["sender_checksum_s"] > 0) == (checksum != "none")
    assert (m["reader_verify_s"] > 0) == (checksum != "none")
    kind = {
        "auto": "fingerprints taken in the step that wrote each slot",  # the default
        "xxh3": "XXH3 of the bytes",
        "blocks": "block digests",
        "none": "none",
    }[checksum]
    out, err = capfd.readouterr()
    assert f"checksum: {kind}, shipping to" in out + err  # the worker's start-up line (vLLM's logger)


def test_the_raw_and_example_arms_move_what_they_claim(tmp_path: Path) -> None:
    from scripts.support.vllm_harness import config_only_model

    nb = -(-TOKENS // bd.BLOCK)
    # r; rc (XXH3 at both ends: ex's ceiling); ra (blocks reused only after the target's ack: d's ceiling)
    for checks, acked in ((False, False), (True, False), (False, True)):
        raw = bd.one_round("RawArm", N_REQ, TOKENS, 2 * nb + 1, 2, checks, acked)
        assert raw["bytes"] == N_REQ * nb * bd.BLOCK * bd.TOKEN_BYTES  # whole blocks, as the arm WRITEs them
        assert raw["cpu_s"] > 0 and raw["seconds"] > 0
        assert 0 < raw["post_s"] < raw["seconds"]
        assert raw["acks"] == (N_REQ if acked else 0)  # every sample acknowledged before its round ends
    model = config_only_model(tmp_path / "wide-llama", bd.HIDDEN, num_layers=4)
    # ea: the raw connector in e's harness, each prompt's blocks held until the target's ack
    pool = 2 * nb * bd.BLOCK * bd.TOKEN_BYTES
    engine = bd.one_round("RawEngineArm", model, N_REQ, TOKENS, 2 * nb + 1, pool)
    assert engine["bytes"] == N_REQ * nb * bd.BLOCK * bd.TOKEN_BYTES  # whole blocks
    assert engine["tokens"] == N_REQ * TOKENS and engine["seconds"] > 0 and engine["cpu_s"] > 0
    assert engine["acks"] == N_REQ  # every prompt's blocks came free at its ack, not before
    example = bd.one_round("ExampleArm", model, N_REQ, TOKENS, 2 * nb + 1)
    assert example["bytes"] == N_REQ * TOKENS * bd.TOKEN_BYTES
    assert example["tokens"] == N_REQ * TOKENS
