"""File names the reader CLI derives from ids a peer chose: one bounded path component,
never hidden, never a separator or a traversal, distinct ids give distinct names; the
layouts put the producer in a directory (default) or the row index in the name
(speculators)."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_connector.files.naming import MAX_NAME, FileLayout, row_index, safe_name, sample_path


@pytest.mark.parametrize("ident", ["cmpl-8f2a-0-1b2c3d4e", "a", "A.b_c@d+e=f-g", "x" * MAX_NAME])
def test_plain_short_ids_are_their_own_names(ident: str) -> None:
    assert safe_name(ident) == ident


@pytest.mark.parametrize(
    "ident",
    [".", "..", ".hidden", ".delivered", "a/b", "../../etc/passwd", "a\nb", "a\tb", "a b", "x:y", "é", "",
     "~", "x" * (MAX_NAME + 1), "y" * 256, "a\x00b"],
)  # fmt: skip
def test_other_ids_get_a_bounded_safe_name(ident: str) -> None:
    name = safe_name(ident)
    assert name != ident
    assert "~" in name and len(name) <= 64 + 1 + 32
    assert "/" not in name and "\x00" not in name and not name.startswith(".")
    assert name.isascii() and name.isprintable()


def test_an_id_that_looks_like_anothers_escaped_name_gets_its_own() -> None:
    forged = safe_name("a b")  # "a_b~<hash>": a legal request id for a producer to choose
    assert safe_name(forged) != forged


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300), st.text(max_size=300))
def test_distinct_ids_get_distinct_names(a: str, b: str) -> None:
    if a != b:
        assert safe_name(a) != safe_name(b)
    for name in (safe_name(a), safe_name(b)):
        assert len(name + ".safetensors") < 255 and "/" not in name and name not in (".", "..")


@pytest.mark.parametrize(
    "sid, row",
    [("0", 0), ("17", 17), ("123456789012", 123456789012), ("017", None), ("-1", None), ("1_0", None),
     ("1e3", None), (" 17", None), ("17\n", None), ("", None), ("row-3", None), ("٣", None)],
)  # fmt: skip
def test_only_plain_decimal_sample_ids_name_a_row(sid: str, row: int | None) -> None:
    assert row_index(sid) == row


def test_the_default_layout_puts_each_producer_in_its_directory() -> None:
    assert sample_path(FileLayout.DEFAULT, "prod-a", "cmpl-1", "17") == PurePosixPath(
        "prod-a/cmpl-1.safetensors"
    )
    a = sample_path(FileLayout.DEFAULT, "prod-a", "r", "r")
    b = sample_path(FileLayout.DEFAULT, "prod-b", "r", "r")
    assert a != b
    long = sample_path(FileLayout.DEFAULT, "p", "r" * 256, "x")
    assert len(long.name) < 255 and long.parent == PurePosixPath("p")


def test_the_speculators_layout_names_files_by_row_and_keeps_the_rest_apart() -> None:
    assert sample_path(FileLayout.SPECULATORS, "p", "cmpl-1", "17") == PurePosixPath("hs_17.safetensors")
    # the same row from another producer or request is the same file: it replaces it
    assert sample_path(FileLayout.SPECULATORS, "q", "cmpl-2", "17") == PurePosixPath("hs_17.safetensors")
    assert sample_path(FileLayout.SPECULATORS, "p", "cmpl-1", "cmpl-1") == PurePosixPath(
        "unnamed/p/cmpl-1.safetensors"
    )
    assert sample_path(FileLayout.SPECULATORS, "p", "r", "017").parts[0] == "unnamed"
