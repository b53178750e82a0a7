"""A sample's identity: sample ids and metadata are checked when a request arrives; a bad
one fails that request alone, with the reason in its kv_transfer_params; a good one
travels in its ship order and its response names it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kv_connector.producer import modes
from kv_connector.producer.options import ConnectorOptions
from kv_connector.producer.planning import NewRequest, ShipOrder
from kv_connector.producer.scheduler_side import SchedulerSide
from kv_connector.producer.worker_report import LinkChange, WorkerReport
from kv_connector.wire.identity import (
    NO_IDENTITY,
    IdentityError,
    SampleIdentity,
    check_sample_id,
    encode_metadata,
    identity_of,
    make_identity,
)


@pytest.mark.parametrize("sid", ["0", "17", "row-17", "a.b:c@d+e=f_g", "x" * 128])
def test_sample_ids_in_the_safe_charset_are_taken(sid: str) -> None:
    assert check_sample_id(sid) == sid


@pytest.mark.parametrize(
    "sid, fragment",
    [
        ("", "1 to 128 characters"),
        ("x" * 129, "1 to 128 characters"),
        ("a b", "may only contain"),
        ("../etc", "may only contain"),
        ("a/b", "may only contain"),
        ("17\n", "may only contain"),
        ("a\tb", "may only contain"),
        ("é", "may only contain"),
        (17, "must be a string"),
    ],
)
def test_other_sample_ids_are_refused_with_the_rule(sid: object, fragment: str) -> None:
    with pytest.raises(IdentityError, match=fragment):
        check_sample_id(sid)


def test_metadata_is_carried_as_compact_json_and_decodes_back() -> None:
    meta = {"source": "sharegpt", "turn": 3, "tags": ["a", "é"], "w": 0.5, "ok": True, "n": None}
    ident = make_identity("17", meta)
    want = '{"source":"sharegpt","turn":3,"tags":["a","é"],"w":0.5,"ok":true,"n":null}'
    assert ident.metadata_json == want.encode()
    assert ident.metadata == meta
    assert encode_metadata(None) == encode_metadata({}) == b""
    assert NO_IDENTITY.metadata == {}


@pytest.mark.parametrize(
    "meta, fragment",
    [
        ([1, 2], "must be a JSON object"),
        ("text", "must be a JSON object"),
        ({"x": float("nan")}, "not plain JSON"),
        ({"x": {1, 2}}, "not plain JSON"),
        ({"x": "y" * 5000}, "at most 4096"),
    ],
)
def test_bad_metadata_is_refused_with_the_reason(meta: object, fragment: str) -> None:
    with pytest.raises(IdentityError, match=fragment):
        encode_metadata(meta)


def test_deeply_nested_metadata_is_refused_not_a_crash() -> None:
    deep: Any = {}
    for _ in range(100_000):
        deep = {"a": deep}
    with pytest.raises(IdentityError):
        encode_metadata(deep)


def test_identity_of_kv_transfer_params() -> None:
    assert identity_of(None) is NO_IDENTITY
    assert identity_of({"include_output_tokens": True}) == NO_IDENTITY
    assert identity_of({"sample_id": "5", "metadata": {"k": 1}}) == SampleIdentity("5", b'{"k":1}')


# ------------------------------------------------------------------ scheduler side


def request(rid: str, params: dict[str, Any] | None, prompt: list[int]) -> SimpleNamespace:
    """The fields of vLLM's Request the scheduler side reads."""
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, all_token_ids=[*prompt, 99])


def scheduler() -> SchedulerSide:
    options = ConnectorOptions.parse({"consumer_address": "127.0.0.1:5555"})
    side = SchedulerSide(options, None, "prod", make_mode=modes.scheduler_mode)
    report = WorkerReport(links=[LinkChange("127.0.0.1:5555", 0, None)])  # rank 0 reaches the reader
    output = SimpleNamespace(kv_connector_worker_meta=SimpleNamespace(report=report), finished_sending=None)
    side.update_connector_output(output)  # type: ignore[arg-type]
    return side


def test_a_request_with_a_bad_sample_id_fails_alone_and_says_why() -> None:
    side = scheduler()
    good = request("good", {"sample_id": "7", "metadata": {"row": 7}}, [1, 2, 3])
    plain = request("plain", None, [4, 5])
    bad = request("bad", {"sample_id": "no spaces"}, [6, 7])
    for r in (good, plain, bad):
        side.on_new_request(r)  # type: ignore[arg-type]
        assert side.get_num_new_matched_tokens(r, 0) == (0, False)  # type: ignore[arg-type]  # every request runs
    new = [NewRequest(r.request_id, r.all_token_ids[:-1], [i], 0) for i, r in enumerate((good, plain, bad))]
    plan = side.planner.plan(new, [], {"good": 3, "plain": 2, "bad": 2})
    assert plan.ships == [
        ShipOrder("good", (1, 2, 3), (0,), SampleIdentity("7", b'{"row":7}'), route="127.0.0.1:5555"),
        ShipOrder("plain", (4, 5), (1,), NO_IDENTITY, route="127.0.0.1:5555"),
    ]

    hold, params = side.request_finished(bad, [2])  # type: ignore[arg-type]
    assert not hold and params is not None
    hs = params["hidden_states"]
    assert hs["status"] == "failed" and "sample_id" in hs["error"] and "may only contain" in hs["error"]
    hold, params = side.request_finished(good, [0])  # type: ignore[arg-type]
    assert hold and params is not None
    assert params["hidden_states"]["sample_id"] == "7" and params["hidden_states"]["request_id"] == "good"
    hold, params = side.request_finished(plain, [1])  # type: ignore[arg-type]
    assert hold and params is not None and params["hidden_states"]["sample_id"] == "plain"


def test_bad_metadata_fails_the_request_alone() -> None:
    side = scheduler()
    bad = request("bad", {"sample_id": "1", "metadata": ["not", "an", "object"]}, [1])
    side.on_new_request(bad)  # type: ignore[arg-type]
    assert side.get_num_new_matched_tokens(bad, 0) == (0, False)  # type: ignore[arg-type]
    assert not side.planner.is_tracked("bad")
    _, params = side.request_finished(bad, [])  # type: ignore[arg-type]
    assert params is not None and "metadata must be a JSON object" in params["hidden_states"]["error"]
