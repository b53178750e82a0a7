"""The host-sync count around the connector's worker hooks (``KV_CONNECTOR_SYNC_CHECK``):
torch's sync debug mode is on for exactly each hook's length, its warnings are counted by
hook and logged, other warnings pass as they were, and nothing else is wrapped. torch
raises its warnings only on a GPU; here a hook raises torch's words itself."""

from __future__ import annotations

import logging
import warnings

import pytest

from kv_connector.producer import sync_watch
from kv_connector.producer.sync_watch import SyncWatch, Watched

SYNC = "called a synchronizing CUDA operation"


class Worker:
    """Hooks that sync (or not) as told, and an attribute that is not a hook."""

    rank = 3

    def __init__(self, modes: list[str | int]) -> None:
        self.modes = modes
        self.seen: list[str | int] = []

    def wait_for_save(self, syncs: int) -> str:
        self.seen.append(self.modes[-1])  # the mode while the hook runs
        for _ in range(syncs):
            warnings.warn(SYNC, UserWarning, stacklevel=1)
        return "saved"

    def get_finished(self) -> None:
        warnings.warn("something else", DeprecationWarning, stacklevel=1)
        raise RuntimeError("the hook failed")

    def stats(self) -> list[int]:
        self.seen.append(self.modes[-1])
        return [1]


def test_each_hooks_syncs_are_counted_and_logged_with_the_mode_on_only_inside_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    modes: list[str | int] = ["default"]
    worker = Worker(modes)
    watch = SyncWatch(lambda: worker.rank, set_mode=modes.append)
    w = Watched(worker, watch)
    with caplog.at_level(logging.WARNING, logger="kv_connector.producer"):
        assert w.wait_for_save(0) == "saved"
        assert watch.counts == {} and not caplog.records
        assert w.wait_for_save(2) == "saved"
    assert worker.seen == ["warn", "warn"]
    assert modes == ["default", "warn", "default", "warn", "default"]
    assert watch.counts == {"wait_for_save": 2}
    line = caplog.records[-1].getMessage()
    assert "rank 3" in line and "wait_for_save (2 so far)" in line and SYNC in line
    # not a hook: neither wrapped nor watched
    assert w.stats() == [1] and worker.seen[-1] == "default" and w.rank == 3


def test_a_failing_hook_turns_the_mode_back_off_and_its_other_warnings_still_show() -> None:
    modes: list[str | int] = ["default"]
    worker = Worker(modes)
    w = Watched(worker, SyncWatch(lambda: 0, set_mode=modes.append))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="the hook failed"):
            w.get_finished()
    assert modes[-1] == "default"
    assert [str(x.message) for x in shown] == ["something else"]


def test_it_is_off_unless_asked_and_never_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sync_watch.ENV, raising=False)
    assert not sync_watch.requested()
    monkeypatch.setenv(sync_watch.ENV, "1")
    monkeypatch.setattr(sync_watch.torch.cuda, "is_available", lambda: False)
    assert not sync_watch.requested()
    monkeypatch.setattr(sync_watch.torch.cuda, "is_available", lambda: True)
    assert sync_watch.requested()
