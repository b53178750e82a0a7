"""Histograms with fixed buckets and bounded observation buffers (``kv_connector.common.observe``)."""

from __future__ import annotations

import pytest

from kv_connector.common.observe import Histogram, Observations, quantile


def test_a_value_falls_in_the_first_bucket_whose_bound_is_at_least_it() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(v)
    assert h.counts == [2, 2, 1]  # <=0.1: 0.05, 0.1; <=1: 0.5, 1.0; +Inf: 7
    assert h.cumulative() == [(0.1, 2), (1.0, 4), (float("inf"), 5)]
    assert h.count == 5 and h.total == pytest.approx(8.65)


def test_a_snapshot_does_not_move_with_the_histogram() -> None:
    h = Histogram((1.0,))
    h.observe(0.5)
    snap = h.snapshot()
    h.observe(0.5)
    assert (snap.count, snap.counts) == (1, [1, 0]) and (h.count, h.counts) == (2, [2, 0])


def test_bounds_must_increase() -> None:
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))
    with pytest.raises(ValueError):
        Histogram((1.0,), counts=[0, 0, 0])


def test_observations_are_bounded_and_drained_once() -> None:
    obs = Observations(limit=3)
    for v in range(5):
        obs.add(v)
    assert len(obs) == 3 and obs.dropped == 2
    assert obs.drain() == [0.0, 1.0, 2.0]
    assert obs.drain() == [] and obs.dropped == 0


def test_quantile_by_nearest_rank() -> None:
    assert quantile([], 0.9) == 0.0
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(11)], 0.9) == 9.0
