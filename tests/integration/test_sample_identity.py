"""Sample identity and the values screen through real NIXL, in the library: a sample's id
and metadata ride in its manifest (covered by the checksum) and come out on ``Sample``;
the values screen (on by default, sampled on a host pool; ``full_values_check`` reads every
value) refuses NaN/Inf, all-zero tokens and all-zero layers to their producer by name and
hands out the rest; ``check_values=False`` hands out what came."""

from __future__ import annotations

from typing import Any

import pytest

from kv_connector.reader import HiddenStatesReader, Sample
from kv_connector.wire.layout import BlockLayout
from tests.integration.common import (
    expected_states,
    finish_sender,
    layout_dict,
    make_cache,
    same_bytes,
    start_sender,
    token_ids,
)

pytestmark = pytest.mark.integration

LAYOUT = BlockLayout("TLH", 16, 3, 32, "bfloat16")
WIDE = BlockLayout("TLH", 16, 3, 256, "bfloat16")  # rows long enough for the screen to sample
CACHE_BLOCKS = 32


def run(
    reader: HiddenStatesReader,
    samples: list[dict[str, Any]],
    n: int,
    layout: BlockLayout = LAYOUT,
    kind: str = "xxh3",
) -> tuple[dict[str, Sample], Any]:
    proc = start_sender(
        dict(address=reader.address, layout=layout_dict(layout), num_cache_blocks=CACHE_BLOCKS, seed=5,
             finite=True, samples=samples, kind=kind)
    )  # fmt: skip
    got: dict[str, Sample] = {}
    try:
        for _ in range(n):
            s = reader.get(timeout=60, copy=True)
            got[s.request_id] = s
        # nothing more to hand out; the values check runs in get(), so this get() also
        # checks (and refuses) a bad sample that became ready after the last good one
        with pytest.raises(TimeoutError):
            reader.get(timeout=2.0)
    finally:
        res = finish_sender(proc)
    return got, res


def test_sample_ids_and_metadata_come_out_with_the_sample() -> None:
    samples = [
        {"request_id": "r-1", "num_tokens": 20, "block_ids": [3, 9], "sample_id": "17",
         "metadata": {"source": "sharegpt", "turn": 2, "tags": ["a", "é"]}},
        {"request_id": "r-2", "num_tokens": 5, "block_ids": [4]},
    ]  # fmt: skip
    with HiddenStatesReader(pool_bytes=1 << 20) as reader:
        got, res = run(reader, samples, 2)
    assert res["rc"] == 0, res["stderr"][-3000:]
    cache = make_cache(LAYOUT, CACHE_BLOCKS, 5, finite=True)
    for s in samples:
        sample = got[s["request_id"]]
        assert sample.sample_id == s.get("sample_id", s["request_id"])
        assert sample.metadata == s.get("metadata", {})
        assert sample.token_ids.tolist() == token_ids(s["request_id"], s["num_tokens"])
        assert same_bytes(
            sample.hidden_states, expected_states(cache, LAYOUT, s["block_ids"], s["num_tokens"])
        )


def test_check_values_refuses_bad_states_to_their_producer_by_name() -> None:
    samples = [
        {"request_id": "good-1", "num_tokens": 20, "block_ids": [1, 2]},
        {"request_id": "nan-2", "num_tokens": 20, "block_ids": [3, 4], "poison": "nan", "sample_id": "2"},
        {"request_id": "zero-3", "num_tokens": 20, "block_ids": [5, 6], "poison": "zero"},
        {"request_id": "good-4", "num_tokens": 3, "block_ids": [7]},
    ]
    with HiddenStatesReader(pool_bytes=1 << 20) as reader:  # the default screens
        got, res = run(reader, samples, 2)
        stats = reader.stats()
    assert sorted(got) == ["good-1", "good-4"]
    assert set(res["failed"]) == {"nan-2", "zero-3"} and sorted(res["finished"]) == ["good-1", "good-4"]
    assert (
        "reader refused (rejected): bad hidden states: NaN/Inf at 1 of 20 tokens: token 0"
        in res["failed"]["nan-2"]
    )
    assert "all zero in every layer: token 0" in res["failed"]["zero-3"]
    assert stats.refused == 2 and stats.values_check_s > 0


@pytest.mark.parametrize("full", [False, True], ids=["default", "full"])
def test_by_default_a_layer_zero_over_a_whole_sample_is_refused_and_full_reads_every_value(
    full: bool,
) -> None:
    """No option given, the screen samples each row: a captured layer that is zero at
    every token of a sample (a layer the extraction never wrote) is refused by name; a lone
    NaN in an element it does not read is handed out (documented), and caught when
    ``full_values_check`` reads every value."""
    samples = [
        {"request_id": "good-1", "num_tokens": 20, "block_ids": [1, 2]},
        {"request_id": "layer-2", "num_tokens": 20, "block_ids": [3, 4], "poison": "layer"},
        {"request_id": "far-3", "num_tokens": 20, "block_ids": [5, 6], "poison": "nan-far"},
        {"request_id": "good-4", "num_tokens": 3, "block_ids": [7]},
    ]
    options = {"full_values_check": True} if full else {}
    with HiddenStatesReader(pool_bytes=4 << 20, **options) as reader:
        got, res = run(reader, samples, 2 if full else 3, WIDE)
        stats = reader.stats()
    assert "captured layer ids 1 all zero at every one of the 20 tokens" in res["failed"]["layer-2"]
    if full:
        assert sorted(got) == ["good-1", "good-4"]
        assert "NaN/Inf at 1 of 20 tokens: token 0 (layer ids 0)" in res["failed"]["far-3"]
    else:
        assert sorted(got) == ["far-3", "good-1", "good-4"]
        assert bool(got["far-3"].hidden_states.float().isnan().any())
    assert stats.refused == (2 if full else 1)


def test_without_check_values_the_library_hands_bad_states_out() -> None:
    """The screen is the user's choice: off, a NaN sample is handed out as it came."""
    samples = [{"request_id": "nan-1", "num_tokens": 5, "block_ids": [3], "poison": "nan"}]
    with HiddenStatesReader(pool_bytes=1 << 20, check_values=False) as reader:
        got, res = run(reader, samples, 1)
    assert res["rc"] == 0 and bool(got["nan-1"].hidden_states.float().isnan().any())


def test_with_fingerprints_the_screen_reads_the_lines_the_checks_read_and_misses_nothing_it_caught() -> None:
    """The default record (fingerprints) and wide rows: each share's rows are screened on
    the lines its check reads on the checking thread, so a good sample's hand-out reads
    nothing more (no values-check time), and every fault the sampled screen catches is
    still refused by name (the hand-out then looks closer); a NaN it does not read is not."""
    good = [{"request_id": f"good-{i}", "num_tokens": 20, "block_ids": [2 * i, 2 * i + 1]} for i in (1, 2)]
    with HiddenStatesReader(pool_bytes=4 << 20) as reader:
        got, res = run(reader, good, 2, WIDE, kind="fingerprint")
        stats = reader.stats()
    assert sorted(got) == ["good-1", "good-2"] and res["rc"] == 0
    assert stats.verify_s > 0 and stats.values_check_s == 0
    samples = [
        {"request_id": "good-1", "num_tokens": 20, "block_ids": [1, 2]},
        {"request_id": "nan-2", "num_tokens": 20, "block_ids": [3, 4], "poison": "nan"},
        {"request_id": "zero-3", "num_tokens": 20, "block_ids": [5, 6], "poison": "zero"},
        {"request_id": "layer-4", "num_tokens": 20, "block_ids": [7, 8], "poison": "layer"},
        {"request_id": "far-5", "num_tokens": 20, "block_ids": [9, 10], "poison": "nan-far"},
    ]
    with HiddenStatesReader(pool_bytes=4 << 20) as reader:
        got, res = run(reader, samples, 2, WIDE, kind="fingerprint")
        stats = reader.stats()
    assert sorted(got) == ["far-5", "good-1"] and bool(got["far-5"].hidden_states.float().isnan().any())
    assert "NaN/Inf at 1 of 20 tokens: token 0 (layer ids 0)" in res["failed"]["nan-2"]
    assert "all zero in every layer: token 0" in res["failed"]["zero-3"]
    assert "captured layer ids 1 all zero at every one of the 20 tokens" in res["failed"]["layer-4"]
    assert stats.refused == 3 and stats.values_check_s > 0
