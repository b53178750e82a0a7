"""A receive pool on a device (``reader.pool.memory``), as far as it runs on CPU tensors:
the device pool's checks agree with the host pool's on the same bytes, leases end through
the pool's stream-order fences (explicitly, by collection, after a copy), a fence holds
an end until its event is done, and a device that cannot hold a pool is refused by name
before anything is made."""

from __future__ import annotations

import functools
import gc
import threading

import pytest
import torch

from kv_connector.reader.pool.hand_out import values_verdict
from kv_connector.reader.pool.lease import CopyBuffers, Lease, sample_view
from kv_connector.reader.pool.memory import (
    DevicePool,
    HostPool,
    LeaseFences,
    PoolDeviceError,
    check_share,
    device_of,
    make_pool,
    run_of,
)
from kv_connector.reader.pool.values import RowsScreen
from kv_connector.wire import protocol
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.protocol import ShareChecksum
from tests.unit.reader.pool.helpers import BASE, POOL, Later, manifest


def both_pools(m: protocol.Manifest, seed: int = 0) -> tuple[HostPool, DevicePool]:
    """A host pool and a device pool (on the host) holding the same sample at BASE."""
    host, dev = HostPool(POOL), DevicePool(POOL, torch.device("cpu"))
    n = m.geometry.sample_bytes(m.num_blocks)
    states = torch.randn(n // 4, generator=torch.Generator().manual_seed(seed)).view(torch.uint8)
    for pool in (host, dev):
        pool.tensor[BASE : BASE + n] = states[:n]
    return host, dev


@pytest.mark.parametrize("layout", ["LTH", "TLH"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 100])
def test_the_device_pool_checks_what_the_host_pool_checks(layout: str, dtype: str, tokens: int) -> None:
    m = manifest(layout, dtype, tokens)
    host, dev = both_pools(m)
    blocks = list(range(m.num_blocks))
    for kind in (ShareChecksum.BLOCKS, ShareChecksum.XXH3):
        for share in (blocks, blocks[::2]):
            assert dev.checksum(BASE, m, share, kind) == host.checksum(BASE, m, share, kind)
    # one byte changed in the last valid token changes both kinds, in both pools
    view = sample_view(run_of(dev.tensor, BASE, m), m)
    before = {k: dev.checksum(BASE, m, blocks, k) for k in ShareChecksum}
    view[-1, -1, -1] += 1
    assert all(dev.checksum(BASE, m, blocks, k) != before[k] for k in ShareChecksum)


def test_the_device_pool_screens_values_as_the_host_pool_does() -> None:
    m = manifest("LTH", "float32", 40)
    host, dev = both_pools(m)
    assert dev.bad_values(BASE, m) is None and host.bad_values(BASE, m) is None
    for pool in (host, dev):
        view = sample_view(run_of(pool.tensor, BASE, m), m)
        view[3, 1, 0] = float("nan")
        view[20].zero_()
    assert dev.bad_values(BASE, m) == host.bad_values(BASE, m)
    problem = dev.bad_values(BASE, m)
    assert problem is not None and "token 3 (layer ids 5)" in problem and "token 20" in problem


@pytest.mark.parametrize("layout", ["LTH", "TLH"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_device_pool_screens_every_value_of_a_share_in_its_check(layout: str, dtype: str) -> None:
    """The check's screen reads each share's whole rows, so what no sampled line would read
    shows, in the share that holds it; a clean sample's hand-out then reads nothing more."""
    m = manifest(layout, dtype, 40)  # blocks of 16: two whole, one of 8 tokens
    _, dev = both_pools(m)
    view = sample_view(run_of(dev.tensor, BASE, m), m)
    view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(3)).to(view.dtype))
    shares = ([0, 2], [1])  # a TP stripe: two runs of blocks, and the block between them

    def screens() -> list[RowsScreen | None]:
        got = [dev.screened(BASE, m, s) for s in shares]
        assert [d for d, _ in got] == [dev.checksum(BASE, m, s, ShareChecksum.FINGERPRINT) for s in shares]
        queued = [dev.queue_fingerprint(BASE, m, s, True) for s in shares]  # the serving thread's way
        assert all(q.event.query() for q in queued) and [q.result() for q in queued] == got
        bare = [dev.queue_fingerprint(BASE, m, s, False).result() for s in shares]  # no screen
        assert bare == [(d, None) for d, _ in got]
        return [screen for _, screen in got]

    assert screens() == [RowsScreen(False, (True, True, True))] * 2
    clean = values_verdict(dev, BASE, m, screens(), full=False)
    assert clean.problem is None and clean.looked_s is None  # nothing read at hand-out
    view[37, 1, 41] = float("nan")  # block 2's, in the middle of a row
    assert [s.suspect for s in screens() if s is not None] == [True, False]
    problem = values_verdict(dev, BASE, m, screens(), full=False).problem
    assert problem is not None and "token 37 (layer ids 5)" in problem
    view[37, 1, 41] = 1.0
    view[20].zero_()  # block 1's token, zero in every layer
    assert [s.suspect for s in screens() if s is not None] == [False, True]
    view[20] = 1.0
    view[:, 2].zero_()  # a layer never written
    assert all(s is not None and s.alive == (True, True, False) and not s.suspect for s in screens())
    problem = values_verdict(dev, BASE, m, screens(), full=False).problem
    assert problem is not None and "captured layer ids 7 all zero" in problem


def test_a_lease_ends_through_the_fences_when_released_collected_or_copied() -> None:
    m = manifest("TLH", "bfloat16", 33)
    _, dev = both_pools(m)
    ended: list[str] = []

    def lease(name: str) -> Lease:
        return Lease(("p", name), dev.ordered(lambda key: ended.append(key[1])))

    la = lease("released")
    view = dev.leased(BASE, m, la)
    assert view.shape == (33, 3, 64) and view.data_ptr() == dev.tensor.data_ptr() + BASE  # no copy
    la.release()
    assert ended == ["released"]  # on the host the work is done: at once
    del view
    gc.collect()
    assert ended == ["released"]  # a lease ends once

    lb = lease("collected")
    view = dev.leased(BASE, m, lb)
    part = view[1:4]  # a view of the view keeps the lease
    del view
    gc.collect()
    assert ended == ["released"]
    del part
    gc.collect()
    assert ended == ["released", "collected"]

    lc = lease("copied")
    copy = dev.copy_out(BASE, m, lc, CopyBuffers(0))
    assert ended[-1] == "copied" and copy.is_contiguous()
    assert copy.data_ptr() != dev.tensor.data_ptr() + BASE
    assert torch.equal(copy.view(torch.int16), sample_view(run_of(dev.tensor, BASE, m), m).view(torch.int16))


def test_a_fenced_end_waits_for_its_event_and_ends_in_any_order() -> None:
    fences = LeaseFences(torch.device("cpu"))
    first, second = Later(), Later()
    ended: list[str] = []
    fences.add(lambda: ended.append("first"), first)
    fences.add(lambda: ended.append("second"), second)
    assert fences.settle() == 2 and ended == [] and fences.waiting == 2
    second.done = True  # streams finish independently
    assert fences.settle() == 1 and ended == ["second"]
    first.done = True
    assert fences.settle() == 0 and ended == ["second", "first"]
    fences.add(lambda: ended.append("now"))  # the host's work is done: at once
    assert ended[-1] == "now" and fences.waiting == 0


def test_an_end_added_while_fences_settle_is_not_lost() -> None:
    """A collector may end a lease on the very thread that settles (inside an end)."""
    fences = LeaseFences(torch.device("cpu"))
    ended: list[str] = []
    outer, inner = Later(), Later()

    def outer_end() -> None:
        ended.append("outer")
        fences.add(lambda: ended.append("inner"), inner)

    fences.add(outer_end, outer)
    outer.done = True
    assert fences.settle() == 1 and ended == ["outer"]  # the inner end waits for its event
    inner.done = True
    assert fences.settle() == 0 and ended == ["outer", "inner"]


def test_fences_take_ends_from_several_threads() -> None:
    fences = LeaseFences(torch.device("cpu"))
    events = [Later() for _ in range(200)]
    ended: list[int] = []
    lock = threading.Lock()

    def end(i: int) -> None:
        with lock:
            ended.append(i)

    def add_every_fourth(k: int) -> None:
        for i in range(k, 200, 4):
            fences.add(functools.partial(end, i), events[i])

    threads = [threading.Thread(target=add_every_fourth, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fences.waiting == 200
    for e in events:
        e.done = True
    assert fences.settle() == 0 and sorted(ended) == list(range(200))


def test_a_device_that_cannot_hold_a_pool_is_refused_by_name() -> None:
    assert device_of("cpu") == torch.device("cpu")
    assert isinstance(make_pool(POOL, None), HostPool)
    assert isinstance(make_pool(POOL, "cpu"), DevicePool)
    with pytest.raises(PoolDeviceError, match="not a device"):
        device_of("graphics card")
    with pytest.raises(PoolDeviceError, match="host memory or on a CUDA GPU"):
        device_of("meta")
    if not torch.cuda.is_available():
        with pytest.raises(PoolDeviceError, match=r"needs CUDA, and torch.cuda.is_available\(\) is False"):
            device_of("cuda:0")
    else:
        with pytest.raises(PoolDeviceError, match="GPU"):
            device_of(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_reader_or_client_asked_for_a_gpu_pool_without_cuda_is_refused_before_anything_is_made() -> None:
    from kv_connector.reader import HiddenStatesReader, PullClient, ReaderConfig

    with pytest.raises(PoolDeviceError, match="needs CUDA"):
        ReaderConfig(pool_device="cuda:0")
    with pytest.raises(PoolDeviceError, match="needs CUDA"):
        HiddenStatesReader(pool_device="cuda")
    with pytest.raises(PoolDeviceError, match="needs CUDA"):
        PullClient(pool_device="cuda:0")


@pytest.mark.parametrize("layout", ["LTH", "TLH"])
def test_a_host_pool_screens_a_fingerprinted_share_on_the_lines_its_check_reads(layout: str) -> None:
    g = BlockLayout(layout, 16, 3, 256, "bfloat16")  # type: ignore[arg-type]
    m = protocol.Manifest(
        request_id="r",
        token_ids=list(range(40)),
        layer_ids=[2, 5, 7],
        geometry=g,
        num_blocks=g.blocks_for(40),
    )
    host, dev = both_pools(m)
    finite = torch.randn(
        m.geometry.sample_bytes(m.num_blocks) // 2, generator=torch.Generator().manual_seed(1)
    )
    for pool in (host, dev):  # bfloat16 values (random bits would hold NaNs)
        run_of(pool.tensor, BASE, m).copy_(finite.to(torch.bfloat16).view(torch.uint8))
    for share in ([0, 1, 2], [1]):
        digest, screen = host.screened(BASE, m, share)
        assert digest == host.checksum(BASE, m, share, ShareChecksum.FINGERPRINT)
        assert screen is not None and not screen.suspect and all(screen.alive)
        # a GPU's pool screens the share's whole rows in the same pass
        assert dev.screened(BASE, m, share) == (digest, RowsScreen(False, (True, True, True)))
        assert (
            check_share(host, BASE, m, share, ShareChecksum.XXH3, True)[1] is None
        )  # only with fingerprints
        assert check_share(host, BASE, m, share, ShareChecksum.FINGERPRINT, False) == (digest, None)
    sample_view(run_of(host.tensor, BASE, m), m)[20].zero_()  # a token of block 1, zero in every layer
    assert host.screened(BASE, m, [0])[1] == screen_rows_of(host, m, [0])
    suspect = host.screened(BASE, m, [1])[1]
    assert suspect is not None and suspect.suspect
    narrow = manifest("TLH", "bfloat16", 40)  # rows the screen reads whole
    assert both_pools(narrow)[0].screened(BASE, narrow, [0, 1, 2])[1] is None


def screen_rows_of(pool: HostPool, m: protocol.Manifest, share: list[int]) -> object:
    """The screen of a share's lines, taken apart from the check (what ``screened`` gives)."""
    from kv_connector.reader.pool.values import screen_rows
    from kv_connector.wire import fingerprint

    _, lines = fingerprint.states_record_lines(sample_view(run_of(pool.tensor, BASE, m), m), m, share)
    assert lines is not None
    return screen_rows(lines)
