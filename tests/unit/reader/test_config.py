"""``ReaderConfig``: validated when built, strings taken for its kinds, and the reader
takes it or its fields as keywords, never both."""

from __future__ import annotations

import pytest

from kv_connector.reader import AckMode, HiddenStatesReader, ReaderConfig, RequireChecksum


def test_kinds_given_as_strings_become_their_types_and_pages_round_up() -> None:
    c = ReaderConfig(ack="manual", require_checksum="never", pool_bytes=1 << 20, page_bytes=100)  # type: ignore[arg-type]
    assert c.ack is AckMode.MANUAL and c.require_checksum is RequireChecksum.NEVER
    assert c.page_bytes == 128  # a multiple of 64
    assert ReaderConfig() == ReaderConfig(ack=AckMode.ON_TAKE)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"ack": "later"}, "ack"),
        ({"require_checksum": "sometimes"}, "require_checksum"),
        ({"sample_timeout_s": 0}, "sample_timeout_s"),
        ({"max_leases": 0}, "max_leases"),
        ({"pool_bytes": 0}, "pool_bytes"),
        ({"pool_bytes": 4096, "page_bytes": 8192}, "page_bytes"),
    ],
)
def test_a_bad_value_is_refused_by_name(kw: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ReaderConfig(**kw)  # type: ignore[arg-type]


def test_the_reader_takes_a_config_or_keywords_not_both() -> None:
    with pytest.raises(TypeError, match="not both"):
        HiddenStatesReader(ReaderConfig(), pool_bytes=1 << 20)
    with pytest.raises(TypeError):
        HiddenStatesReader(pool_megabytes=1)  # not a field
