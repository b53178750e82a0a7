"""Receive-pool credit accounting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_connector.reader.pool.pages import PagePool, PoolTooSmall


def test_grants_in_arrival_order_and_waits_for_room() -> None:
    pool = PagePool(4)
    pool.request("a", 3)
    pool.request("b", 2)
    pool.request("c", 1)
    ((key, pages),) = pool.grantable()
    assert key == "a" and len(pages) == 3
    # b does not fit; c would, but must not overtake b.
    assert pool.grantable() == []
    pool.release("a", pages)
    got = dict(pool.grantable())
    assert set(got) == {"b", "c"} and pool.free_pages == 1


def test_pool_too_small_and_bad_release() -> None:
    pool = PagePool(2)
    with pytest.raises(PoolTooSmall, match="larger"):
        pool.request("x", 3)
    pool.request("x", 2)
    ((_, pages),) = pool.grantable()
    with pytest.raises(ValueError, match="not held"):
        pool.release("y", pages)
    with pytest.raises(ValueError):
        pool.request("z", 0)


def test_cancel_removes_a_waiting_request() -> None:
    pool = PagePool(1)
    pool.request("a", 1)
    pool.request("b", 1)
    pool.grantable()
    assert pool.cancel("b") and not pool.cancel("b")
    assert pool.waiting == 0


@given(st.lists(st.integers(1, 8), min_size=1, max_size=40))
def test_pages_are_never_shared_and_all_return(needs: list[int]) -> None:
    pool = PagePool(8)
    for i, n in enumerate(needs):
        pool.request(i, n)
    held: dict[int, list[int]] = {}
    while len(held) < len(needs) or held:
        for key, pages in pool.grantable():
            held[key] = pages  # type: ignore[index]
        in_use = [p for ps in held.values() for p in ps]
        assert len(in_use) == len(set(in_use)) and pool.used_pages == len(in_use)
        if not held:
            break
        key = next(iter(held))
        pool.release(key, held.pop(key))
    assert pool.free_pages == 8 and pool.waiting == 0
