"""A reader's host pool offered to producers on its node (``node_pool``): real sender
processes map it and copy each share into it, then notify through NIXL; the samples
arrive byte for byte, the producer reports the pairing as ``node_pool``; with the
producer's switch off, or without the offer, the same samples go through UCX; the offer
is gone once the reader closes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_connector.reader import HiddenStatesReader
from kv_connector.wire import node_pool
from kv_connector.wire.layout import BlockLayout
from tests.integration.common import (
    CPU_LAYOUT,
    GPU_LAYOUT,
    NUM_CACHE_BLOCKS,
    Senders,
    check,
    collect,
    finish_sender,
    layout_dict,
    plan,
)

pytestmark = pytest.mark.integration

WRITE_HOST = "WRITE from host memory to host memory on this node"


def writes_of(res: dict[str, object]) -> list[str]:
    transports = res["transports"]
    assert isinstance(transports, dict)
    return sorted({t for pairings in transports.values() for t in pairings.get(WRITE_HOST, [])})


@pytest.mark.parametrize("layout", [CPU_LAYOUT, GPU_LAYOUT], ids=["cpu-LTH-fp32", "gpu-TLH-bf16"])
def test_a_producer_on_the_node_copies_into_the_offered_pool(
    layout: BlockLayout, senders: Senders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    bs = layout.block_size
    samples = plan([1, bs, bs + 1, 7 * bs + 5, 2 * bs - 1], seed=1, layout=layout)
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes, node_pool=True) as reader:
        offer = node_pool.read_offer(reader.reader_id, node_pool.offer_dir())
        assert offer is not None and offer.nbytes == 64 * layout.block_bytes
        got, res = senders.deliver(reader, layout, 1, samples)
    assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    check(got, samples, layout, seed=1)
    assert writes_of(res) == [node_pool.TRANSPORT]
    assert node_pool.read_offer(reader.reader_id, node_pool.offer_dir()) is None  # withdrawn


@pytest.mark.parametrize("how", ["producer-off", "no-offer"])
def test_without_the_offer_or_with_the_switch_off_ucx_writes(
    how: str, senders: Senders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    layout = CPU_LAYOUT
    samples = plan([1, 40, 100], seed=2, layout=layout)
    env = {node_pool.SWITCH: "0"} if how == "producer-off" else {}
    with HiddenStatesReader(pool_bytes=64 * layout.block_bytes, node_pool=how != "no-offer") as reader:
        spec = dict(
            address=reader.address,
            layout=layout_dict(layout),
            num_cache_blocks=NUM_CACHE_BLOCKS,
            seed=2,
            samples=samples,
        )
        proc = senders.start(spec, env)
        got = collect(reader, len(samples))
        res = finish_sender(proc)
    assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    check(got, samples, layout, seed=2)
    ucx = writes_of(res)
    assert ucx and node_pool.TRANSPORT not in ucx  # UCX's own transport, as its report names it


def test_a_device_pool_is_not_offered() -> None:
    with pytest.raises(ValueError, match="node_pool"):
        HiddenStatesReader(pool_bytes=1 << 20, node_pool=True, pool_device="cpu")
