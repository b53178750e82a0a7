"""ConnectorOptions.parse: the connector's kv_connector_extra_config, validated once.

Every rejection must be a ValueError whose message names the offending key, because that
message is what vLLM prints when it fails at startup."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

import pytest

from kv_connector.producer.options import (
    ConnectorOptions,
    PushOptions,
    Sharding,
    captured_layer_order,
    producer_id_for,
    replica_of,
)

GOOD = "127.0.0.1:5555"
TIMEOUT_KEYS = ["connect_timeout_s", "drain_timeout_s"]


def parse_error(extra: Any) -> str:
    with pytest.raises(ValueError) as info:
        ConnectorOptions.parse(extra)
    return str(info.value)


# ------------------------------------------------------------------ good values


def test_only_consumer_address_gives_the_documented_defaults() -> None:
    opts = ConnectorOptions.parse({"consumer_address": GOOD})
    assert opts == ConnectorOptions(
        push=PushOptions(readers=(GOOD,), sharding=Sharding.REQUEST_HASH),
        producer_id=None,
        connect_timeout_s=60.0,
        drain_timeout_s=60.0,
        include_output_tokens=False,
    )
    assert opts.push.readers == (GOOD,)


def test_every_key_is_read_and_integer_timeouts_become_floats() -> None:
    opts = ConnectorOptions.parse(
        {
            "consumer_address": "[::1]:7000",
            "producer_id": "p" * 128,
            "connect_timeout_s": 5,
            "drain_timeout_s": 0.25,
            "include_output_tokens": True,
        }
    )
    assert opts.push.readers == ("[::1]:7000",)
    assert opts.producer_id == "p" * 128
    assert opts.connect_timeout_s == 5.0 and type(opts.connect_timeout_s) is float
    assert opts.drain_timeout_s == 0.25
    assert opts.include_output_tokens is True


def test_any_mapping_is_accepted_and_left_unchanged() -> None:
    extra = {"consumer_address": GOOD, "include_output_tokens": False}
    frozen = MappingProxyType(extra)
    assert ConnectorOptions.parse(frozen).push.readers == (GOOD,)
    assert extra == {"consumer_address": GOOD, "include_output_tokens": False}


@pytest.mark.parametrize("address", ["localhost:0", "10.0.0.1:65535", "[fe80::1]:80", "reader.example:9"])
def test_well_formed_addresses_are_kept_verbatim(address: str) -> None:
    assert ConnectorOptions.parse({"consumer_address": address}).push.readers == (address,)


# ------------------------------------------------------------- consumer_address


@pytest.mark.parametrize("extra", [None, {}], ids=["none", "empty-dict"])
def test_missing_consumer_address_is_named_with_an_example(extra: Any) -> None:
    msg = parse_error(extra)
    assert "kv_connector_extra_config.consumer_address" in msg
    assert '"consumer_address":"HOST:PORT"' in msg  # the example command line


@pytest.mark.parametrize("value", ["", None, 5555, [], ["127.0.0.1:1", 5], b"127.0.0.1:1"])
def test_empty_or_non_string_consumer_address_is_named(value: Any) -> None:
    assert "consumer_address" in parse_error({"consumer_address": value})


@pytest.mark.parametrize(
    "value, why",
    [
        ("localhost", "not HOST:PORT"),
        (":80", "not HOST:PORT"),
        ("host:port", "non-numeric port"),
        ("host:", "non-numeric port"),
        ("host:65536", "outside 0-65535"),
        ("host:-1", "outside 0-65535"),
    ],
)
def test_malformed_consumer_address_is_named_with_the_reason(value: str, why: str) -> None:
    msg = parse_error({"consumer_address": value})
    assert msg.startswith("kv_connector_extra_config.consumer_address:")
    assert why in msg and repr(value) in msg


# ----------------------------------------------------------------- unknown keys


def test_unknown_key_is_named_with_the_known_ones() -> None:
    msg = parse_error({"consumer_address": GOOD, "consumer_adress": GOOD})
    assert "'consumer_adress'" in msg
    for known in ["consumer_address", "producer_id", "connect_timeout_s", "drain_timeout_s"]:
        assert known in msg


def test_every_unknown_key_is_named_even_without_an_address() -> None:
    msg = parse_error({"timeout": 1, "include_output": True})
    assert "unknown" in msg and "'include_output'" in msg and "'timeout'" in msg


# --------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("key", TIMEOUT_KEYS)
@pytest.mark.parametrize(
    "value", [0, 0.0, -1, -0.5, True, False, "10", None, [5]], ids=lambda v: f"{type(v).__name__}-{v}"
)
def test_bad_timeout_is_named(key: str, value: Any) -> None:
    msg = parse_error({"consumer_address": GOOD, key: value})
    assert f"kv_connector_extra_config.{key}" in msg
    assert "positive number of seconds" in msg


@pytest.mark.parametrize("key", TIMEOUT_KEYS)
def test_a_tiny_positive_timeout_is_accepted(key: str) -> None:
    assert getattr(ConnectorOptions.parse({"consumer_address": GOOD, key: 1e-3}), key) == 1e-3


@pytest.mark.parametrize("key", TIMEOUT_KEYS)
def test_nan_timeout_is_rejected(key: str) -> None:
    msg = parse_error({"consumer_address": GOOD, key: math.nan})
    assert key in msg


# --------------------------------------------------------- include_output_tokens


@pytest.mark.parametrize("value", ["true", "false", 1, 0, None, "yes"])
def test_non_boolean_include_output_tokens_is_named(value: Any) -> None:
    msg = parse_error({"consumer_address": GOOD, "include_output_tokens": value})
    assert "kv_connector_extra_config.include_output_tokens" in msg
    assert "true or false" in msg


@pytest.mark.parametrize("value", [True, False])
def test_boolean_include_output_tokens_is_kept(value: bool) -> None:
    opts = ConnectorOptions.parse({"consumer_address": GOOD, "include_output_tokens": value})
    assert opts.include_output_tokens is value


# ------------------------------------------------------------------ producer_id


@pytest.mark.parametrize("value", ["", 7, "p" * 129, ["p"]])
def test_bad_producer_id_is_named(value: Any) -> None:
    assert "kv_connector_extra_config.producer_id" in parse_error(
        {"consumer_address": GOOD, "producer_id": value}
    )


def test_explicit_null_producer_id_means_the_default() -> None:
    assert ConnectorOptions.parse({"consumer_address": GOOD, "producer_id": None}).producer_id is None


def test_a_list_of_readers_shards_samples_over_them() -> None:
    opts = ConnectorOptions.parse(
        {"consumer_address": ["10.0.0.1:1", "10.0.0.2:1"], "sharding": "round_robin"}
    )
    assert opts.push.readers == ("10.0.0.1:1", "10.0.0.2:1") and opts.push.sharding == "round_robin"


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"consumer_address": ["10.0.0.1:1", "10.0.0.1:1"]}, "twice"),
        ({"consumer_address": ["10.0.0.1:1", "nonsense"]}, "consumer_address"),
        ({"consumer_address": GOOD, "sharding": "random"}, "sharding"),
    ],
)
def test_bad_reader_lists_and_sharding_are_named(extra: dict[str, Any], fragment: str) -> None:
    assert fragment in parse_error(extra)


def test_the_checksum_kind_follows_where_the_cache_is_unless_asked() -> None:
    from kv_connector.producer.options import ChecksumOption
    from kv_connector.wire.layout import BlockLayout
    from kv_connector.wire.protocol import ShareChecksum

    assert ConnectorOptions.parse({"consumer_address": GOOD}).checksum is ChecksumOption.AUTO
    kinds = {c: ConnectorOptions.parse({"consumer_address": GOOD, "checksum": c}).checksum for c in CHECKSUMS}
    assert kinds == {c: ChecksumOption(c) for c in ("auto", "fingerprint", "xxh3", "blocks", "none")}
    words = BlockLayout("TLH", 16, 2, 64, "bfloat16")  # rows of 128 bytes: whole 8-byte words
    odd = BlockLayout("TLH", 16, 2, 3, "bfloat16")  # rows of 6 bytes: not
    blocks, xxh3, fp = ShareChecksum.BLOCKS, ShareChecksum.XXH3, ShareChecksum.FINGERPRINT
    # (device cache, layout) -> the one value the rank ships with
    want = {
        ChecksumOption.AUTO: {
            (True, words): fp,
            (True, odd): xxh3,
            (False, words): fp,
            (False, odd): xxh3,
        },
        ChecksumOption.FINGERPRINT: {(True, words): fp, (False, words): fp},
        ChecksumOption.BLOCKS: {(True, words): blocks, (False, words): blocks},
        ChecksumOption.XXH3: dict.fromkeys([(True, words), (True, odd), (False, words), (False, odd)], xxh3),
        ChecksumOption.NONE: dict.fromkeys([(True, words), (True, odd), (False, words), (False, odd)], None),
    }
    for kind, cases in want.items():
        assert {case: kind.resolve(*case) for case in cases} == cases, kind
    for device in (True, False):  # asked for block digests of rows they cannot read: refused once, here
        for asked in (ChecksumOption.BLOCKS, ChecksumOption.FINGERPRINT):
            with pytest.raises(ValueError, match="whole 8-byte words"):
                asked.resolve(device, odd)
    assert "checksum" in parse_error({"consumer_address": GOOD, "checksum": "crc32"})


CHECKSUMS = ("auto", "fingerprint", "xxh3", "blocks", "none")


# ------------------------------------------------------- captured layer order


@pytest.mark.parametrize(
    ("configured", "order"),
    [
        ([1, 2, 4], [1, 2, 4]),
        ([5, 1, 3], [1, 3, 5]),
        ([3, 1, 2], [1, 2, 3]),
        ([7], [7]),
        ((32, 0, 16), [0, 16, 32]),
    ],
)
def test_states_come_in_increasing_layer_id_whatever_the_configured_order(
    configured: list[int], order: list[int]
) -> None:
    assert captured_layer_order(configured) == order


@pytest.mark.parametrize(("configured", "duplicate"), [([5, 1, 3, 3], 3), ([2, 2], 2), ([0, 4, 0, 4], 0)])
def test_a_duplicate_layer_id_is_refused_naming_it_and_the_fix(configured: list[int], duplicate: int) -> None:
    with pytest.raises(ValueError) as info:
        captured_layer_order(configured)
    msg = str(info.value)
    assert f"lists layer {duplicate} more than once" in msg
    assert f"e.g. {sorted(set(configured))}" in msg


def test_an_infinite_timeout_is_no_deadline_and_refused() -> None:
    assert "connect_timeout_s" in parse_error({"consumer_address": GOOD, "connect_timeout_s": math.inf})


def test_options_built_in_python_check_their_readers_too() -> None:
    with pytest.raises(ValueError, match="consumer_address"):
        ConnectorOptions(push=PushOptions(readers=()))
    with pytest.raises(ValueError, match="twice"):
        ConnectorOptions(push=PushOptions(readers=(GOOD, GOOD)))


def test_credits_ahead_defaults_to_two_and_bad_values_are_named() -> None:
    assert ConnectorOptions.parse({"consumer_address": GOOD}).push.credits_ahead == 2
    assert ConnectorOptions.parse({"consumer_address": GOOD, "credits_ahead": 0}).push.credits_ahead == 0
    for bad in (-1, 9, 1.5, "2", None, True):
        msg = parse_error({"consumer_address": GOOD, "credits_ahead": bad})
        assert "kv_connector_extra_config.credits_ahead must be a whole number from 0 to 8" in msg, msg


def test_each_data_parallel_replica_is_a_producer_of_its_own_name() -> None:
    """vLLM appends ``_dp{n}`` to each replica's engine id (replica 0's too): the default
    name carries it, and a name given in the options gets ``-dp{n}``, so two replicas never
    meet at a reader under one name."""
    assert replica_of("a1b2") is None and replica_of("a1b2_dp0") == 0 and replica_of("x_dp12") == 12
    assert replica_of("dp3") is None and replica_of("x_dp3_y") is None
    assert producer_id_for(None, "e1_dp1") == "vllm-e1_dp1"
    assert producer_id_for("gen", "e1") == "gen"
    names = {producer_id_for("gen", f"e1_dp{n}") for n in range(4)}
    assert names == {"gen-dp0", "gen-dp1", "gen-dp2", "gen-dp3"}
