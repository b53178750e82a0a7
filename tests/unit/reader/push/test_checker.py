"""The reader's share checks on a device pool: a fingerprint check is queued on the pool's
stream by the thread that learned the share landed, and read in a later turn of its busy
poll once the check's event says the work is done. Nothing waits for the device and no
thread is handed the sample. The pool runs on the host here (what CI has); its event is
held back as a GPU's would be until its kernels ran. The ledger is a stand-in that records
what the checker tells it (pure logic: the reader's transfers are the integration tests')."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import pytest
import torch

from kv_connector.reader.pool.lease import sample_view
from kv_connector.reader.pool.memory import DevicePool, QueuedCheck, run_of
from kv_connector.reader.pool.values import RowsScreen
from kv_connector.reader.push.checker import ShareChecker
from kv_connector.reader.push.records import Action, CheckShare, ShareToCheck
from kv_connector.wire import fingerprint
from kv_connector.wire.protocol import ShareChecksum
from tests.unit.reader.pool.helpers import BASE, POOL, Later, manifest


class _Ledger:
    """What the checker asks of the reader's ledger, and what it was told."""

    def __init__(self, where: ShareToCheck | None) -> None:
        self.where = where
        self.checked: list[tuple[int, bool, RowsScreen | None]] = []
        self.view = self  # it answers the view's question too

    def share_to_check(self, job: CheckShare) -> ShareToCheck | None:
        return self.where

    def share_checked(
        self,
        key: object,
        rank: int,
        landing: int,
        ok: bool,
        now: float,
        seconds: float,
        screen: RowsScreen | None,
    ) -> list[Action]:
        self.checked.append((landing, ok, screen))
        return []


@pytest.fixture
def pool() -> DevicePool:
    return DevicePool(POOL, torch.device("cpu"))


def _held(pool: DevicePool, monkeypatch: pytest.MonkeyPatch) -> list[Later]:
    """Every check the pool queues gets an event that is done only once told so."""
    events: list[Later] = []
    queue = pool.queue_fingerprint

    def held(base: int, m: object, blocks: list[int], screen: bool) -> QueuedCheck:
        q = queue(base, m, blocks, screen)  # type: ignore[arg-type]
        events.append(Later())
        q.event = events[-1]
        return q

    monkeypatch.setattr(pool, "queue_fingerprint", held)
    return events


def _checker(pool: DevicePool, ledger: _Ledger, screen: bool = True) -> ShareChecker:
    performed: list[Iterable[Action]] = []
    return ShareChecker(pool, ledger, threading.RLock(), performed.append, screen)  # type: ignore[arg-type]


@pytest.mark.parametrize("screen", [True, False])
def test_a_device_pools_fingerprint_check_is_read_once_its_event_is_done(
    pool: DevicePool, monkeypatch: pytest.MonkeyPatch, screen: bool
) -> None:
    m = manifest("LTH", "bfloat16", 40)
    view = sample_view(run_of(pool.tensor, BASE, m), m)
    view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(1)).to(view.dtype))
    blocks = list(range(m.num_blocks))
    checksum = fingerprint.states_record(view, m, blocks)
    ledger = _Ledger(ShareToCheck(BASE, m, tuple(blocks)))
    events = _held(pool, monkeypatch)
    checker = _checker(pool, ledger, screen)
    try:
        checker.submit(CheckShare(("p", "r"), 0, 1, checksum, ShareChecksum.FINGERPRINT))
        # a wrong checksum
        checker.submit(CheckShare(("p", "r"), 0, 2, checksum ^ 1, ShareChecksum.FINGERPRINT))
        assert ledger.checked == [] and checker.waiting == 2  # queued; nobody waited
        assert checker.settle() == 2 and ledger.checked == []
        events[1].done = True  # the device finishes checks in any order
        assert checker.settle() == 1 and [(a, ok) for a, ok, _ in ledger.checked] == [(2, False)]
        events[0].done = True
        assert checker.settle() == 0 and [(a, ok) for a, ok, _ in ledger.checked] == [(2, False), (1, True)]
        want = RowsScreen(False, (True, True, True)) if screen else None
        assert all(s == want for _, _, s in ledger.checked)
    finally:
        checker.close()


def test_a_share_gone_before_its_check_is_queued_is_not_checked(
    pool: DevicePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _held(pool, monkeypatch)
    ledger = _Ledger(None)  # dropped, or landed again since
    checker = _checker(pool, ledger)
    try:
        checker.submit(CheckShare(("p", "r"), 0, 1, 0, ShareChecksum.FINGERPRINT))
        assert events == [] and checker.waiting == 0 and ledger.checked == []
    finally:
        checker.close()


def test_a_check_that_cannot_be_read_is_logged_and_the_others_go_on(
    pool: DevicePool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    m = manifest("TLH", "float32", 16)
    blocks = list(range(m.num_blocks))
    checksum = fingerprint.states_record(sample_view(run_of(pool.tensor, BASE, m), m), m, blocks)
    ledger = _Ledger(ShareToCheck(BASE, m, tuple(blocks)))
    events = _held(pool, monkeypatch)
    checker = _checker(pool, ledger)
    try:
        checker.submit(CheckShare(("p", "bad"), 0, 1, checksum, ShareChecksum.FINGERPRINT))
        checker.submit(CheckShare(("p", "good"), 0, 2, checksum, ShareChecksum.FINGERPRINT))
        monkeypatch.setattr(QueuedCheck, "result", _fails_once(QueuedCheck.result))
        for e in events:
            e.done = True
        assert checker.settle() == 0
        assert [(a, ok) for a, ok, _ in ledger.checked] == [(2, True)]
        assert "checking ('p', 'bad') rank 0 failed" in caplog.text
    finally:
        checker.close()


def _fails_once(result):  # type: ignore[no-untyped-def]
    calls = []

    def once(self: QueuedCheck) -> tuple[int, RowsScreen | None]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the device lost it")
        return result(self)  # type: ignore[no-any-return]

    return once
