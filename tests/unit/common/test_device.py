"""Every sender thread that touches a CUDA cache or drives the NIXL agent holding its
registration makes the cache's GPU its device first (``common.device.on_device``); on a
host cache none of them touches CUDA. torch.cuda.set_device is replaced by a recorder:
these run without a GPU."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kv_connector.cache.hasher import Hasher
from kv_connector.common.device import on_device
from kv_connector.sender.config import SenderConfig
from kv_connector.sender.ledger import SendLedger
from kv_connector.sender.loop import LoopParts, SenderLoop
from kv_connector.sender.writer import ShareWriter
from kv_connector.wire import handshake
from kv_connector.wire.transport import Region
from tests.ports import address_of, held_port

GPU1 = torch.device("cuda", 1)
Calls = list[tuple[str, torch.device]]


@pytest.fixture
def set_device_calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    calls: Calls = []

    def record(device: torch.device) -> None:
        calls.append((threading.current_thread().name, device))

    monkeypatch.setattr(torch.cuda, "set_device", record)
    return calls


def _wait_for(calls: Calls, name: str) -> list[torch.device]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        got = [d for n, d in calls if n == name]
        if got:
            return got
        time.sleep(0.005)
    return []


def test_on_device_sets_a_gpu_and_leaves_the_host_alone(set_device_calls: Calls) -> None:
    on_device(torch.device("cpu"))
    on_device(None)
    assert set_device_calls == []
    on_device(GPU1)
    assert set_device_calls == [(threading.current_thread().name, GPU1)]


def test_hasher_thread_sets_the_cache_device_first(set_device_calls: Calls) -> None:
    h = Hasher("hs-hash-r3", GPU1)
    try:
        assert _wait_for(set_device_calls, "hs-hash-r3") == [GPU1]
        # the checksum runs on the same thread, after the device was set
        assert h.submit(lambda: len(set_device_calls)).result(timeout=5) == 1
    finally:
        h.close()


def test_writer_thread_sets_the_cache_device_first(set_device_calls: Calls) -> None:
    w = ShareWriter(
        object(),  # type: ignore[arg-type]  # never called: no reader connected
        Region(0, 1, "VRAM", 1),
        SendLedger(),
        threading.Lock(),
        3,
        lambda f: None,
        GPU1,
    )
    try:
        assert _wait_for(set_device_calls, "hs-writer-r3") == [GPU1]
    finally:
        w.close()


def test_sender_loop_thread_sets_the_cache_device_first(set_device_calls: Calls) -> None:
    sock = held_port()  # bound, not listening: every connection is refused
    lock = threading.Lock()
    ledger = SendLedger()
    writer = ShareWriter(object(), Region(0, 1, "VRAM", 1), ledger, lock, 3, lambda f: None, GPU1)  # type: ignore[arg-type]
    me = handshake.ProducerIdentity("p", 3, 4, "agent", 4096, "VRAM", "blocks")
    config = SenderConfig(address_of(sock), "p", rank=3, world_size=4, connect_timeout_s=30.0)
    parts = LoopParts(object(), ledger, lock, writer, device=GPU1)  # type: ignore[arg-type]
    loop = SenderLoop(config, me, None, parts)
    try:
        loop.start()
        assert _wait_for(set_device_calls, "hs-sender-r3") == [GPU1]
    finally:
        loop.close()
        writer.close()
        sock.close()


def test_a_host_cache_never_sets_a_device(set_device_calls: Calls) -> None:
    h = Hasher("hs-hash-r0", torch.device("cpu"))
    try:
        h.submit(lambda: 0).result(timeout=5)
    finally:
        h.close()
    assert set_device_calls == []


class _PoolOn:
    """What the reader's threads read of a pool: its device and its fences."""

    def __init__(self, device: torch.device) -> None:
        from kv_connector.reader.pool.memory import LeaseFences

        self.device = device
        self.lease_fences = LeaseFences(torch.device("cpu"))


def test_the_readers_serving_and_checking_threads_set_a_gpu_pools_device_first(
    set_device_calls: Calls,
) -> None:
    """A pool on a GPU (``pool_device``): the thread that drives the NIXL agent holding its
    registration, and the one that checks shares where they lie, make its GPU theirs."""
    import socket

    from kv_connector.reader.push.ledger import ReaderLedger
    from kv_connector.reader.push.server import ReaderServer, ServerParts

    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    parts = ServerParts(
        listen=lsock,
        transport=object(),  # type: ignore[arg-type]
        region=Region(0, 1, "VRAM", 1),
        ledger=ReaderLedger(),
        lock=threading.RLock(),
        pool=_PoolOn(GPU1),  # type: ignore[arg-type]
        secret=None,
        reader_id="r",
        on_ready=lambda key: None,
    )
    server = ReaderServer(parts)
    try:
        server.start()
        assert _wait_for(set_device_calls, "hs-reader-check") == [GPU1]
        assert _wait_for(set_device_calls, server.thread.name) == [GPU1]
    finally:
        server.close()
