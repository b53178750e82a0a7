"""``wire.provenance``: what a sample says it is, what a trainer expects, and each
difference named."""

from __future__ import annotations

import msgspec
import pytest

from kv_connector.wire import protocol
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.provenance import Expectation, ModelRunner, Provenance, model_matches

LAYOUT = BlockLayout("TLH", 16, 3, 64, "bfloat16")
PROV = Provenance(
    vllm_version="0.33.0", model_runner=ModelRunner.V2, model="/models/Qwen/Qwen3-8B", revision="abc"
)


def manifest(provenance: Provenance | None = PROV, layer_ids: list[int] | None = None) -> protocol.Manifest:
    return protocol.Manifest(
        request_id="r1", token_ids=list(range(20)), layer_ids=layer_ids or [2, 16, 36], geometry=LAYOUT,
        num_blocks=2, provenance=provenance,
    )  # fmt: skip


def test_a_manifest_carries_its_provenance_over_the_wire() -> None:
    msg = protocol.CreditRequest(manifest=manifest(), blocks=[0, 1])
    got = protocol.decode(protocol.encode(msg))
    assert isinstance(got, protocol.CreditRequest) and got.manifest.provenance == PROV
    assert got.manifest.provenance.model_runner is ModelRunner.V2
    unnamed = protocol.decode(protocol.encode(protocol.CreditRequest(manifest=manifest(None), blocks=[0, 1])))
    assert isinstance(unnamed, protocol.CreditRequest) and unnamed.manifest.provenance is None


def test_a_provenance_with_an_unknown_runner_or_no_model_does_not_decode() -> None:
    raw = msgspec.msgpack.encode({"vllm_version": "0.33.0", "model_runner": "v3", "model": "m"})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=Provenance)
    raw = msgspec.msgpack.encode({"vllm_version": "0.33.0", "model_runner": "v1", "model": ""})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=Provenance)


def test_what_is_expected_passes_and_nothing_expected_passes_anything() -> None:
    assert Expectation().mismatches(manifest()) == []
    assert Expectation().mismatches(manifest(None)) == []
    exact = Expectation(layer_ids=[2, 16, 36], dtype="bfloat16", hidden_size=64, model="Qwen/Qwen3-8B")
    assert exact.mismatches(manifest()) == []


def test_each_difference_is_named() -> None:
    want = Expectation(
        layer_ids=[2, 16, 35], dtype="float32", hidden_size=4096, model="meta-llama/Llama-3.1-8B"
    )
    assert want.mismatches(manifest()) == [
        "layer ids [2, 16, 36], expected [2, 16, 35]",
        "dtype bfloat16, expected float32",
        "hidden size 64, expected 4096",
        "model /models/Qwen/Qwen3-8B, expected meta-llama/Llama-3.1-8B",
    ]
    # the same layers in another order are other data: a mismatch
    assert Expectation(layer_ids=[16, 2, 36]).mismatches(manifest()) == [
        "layer ids [2, 16, 36], expected [16, 2, 36]"
    ]
    assert Expectation(model="Qwen/Qwen3-8B").mismatches(manifest(None)) == [
        "no model named by its producer, expected Qwen/Qwen3-8B"
    ]


def test_a_model_matches_by_name_or_by_its_last_path_components() -> None:
    assert model_matches("Qwen/Qwen3-8B", "Qwen/Qwen3-8B")
    assert model_matches("Qwen/Qwen3-8B", "/models/Qwen/Qwen3-8B")
    assert model_matches("Qwen3-8B", "/models/Qwen/Qwen3-8B/")
    assert not model_matches("Qwen/Qwen3-8B", "/models/Qwen/Qwen3-8B-Base")
    assert not model_matches("Qwen3-8B", "/models/MyQwen3-8B")


def test_an_expectation_is_checked_when_built() -> None:
    with pytest.raises(ValueError, match="repeat"):
        Expectation(layer_ids=[2, 2])
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"dtype": "int8"}, Expectation)


def test_provenance_flattens_for_file_metadata() -> None:
    assert PROV.as_dict() == {
        "vllm_version": "0.33.0", "model_runner": "v2", "model": "/models/Qwen/Qwen3-8B", "revision": "abc"
    }  # fmt: skip
    plain = Provenance(vllm_version="0.32.0", model_runner=ModelRunner.V1, model="m")
    assert "revision" not in plain.as_dict()
