"""A pool offered to producers on the node: the offer is found by the reader's agent
name and refused when it is of another boot, of a process gone, or of a file replaced;
a producer that maps it writes the reader's very pages; spans are copied where they say
and never outside their memory."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kv_connector.common.memory import shared_host_memory
from kv_connector.wire import node_pool


def offered(tmp_path: Path, nbytes: int = 1 << 16) -> tuple[np.ndarray, int, node_pool.Offer]:
    pool, fd = shared_host_memory(nbytes)
    offer = node_pool.make_offer("reader-1", fd, pool.ctypes.data, nbytes)
    node_pool.publish(offer, tmp_path)
    return pool, fd, offer


def test_an_offer_is_found_by_its_agent_and_maps_the_readers_pages(tmp_path: Path) -> None:
    pool, fd, offer = offered(tmp_path)
    assert node_pool.read_offer("reader-1", tmp_path) == offer
    assert node_pool.read_offer("reader-2", tmp_path) is None
    mapped, why = node_pool.attach("reader-1", tmp_path)
    assert mapped is not None, why
    mapped.tensor[100:104] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert pool[100:104].tolist() == [1, 2, 3, 4]  # the same pages, not a copy
    assert mapped.covers(offer.addr + 10, 100) and not mapped.covers(offer.addr + 10, offer.nbytes)
    mapped.close()
    os.close(fd)


def test_offers_of_another_boot_a_process_gone_or_a_file_replaced_are_refused(tmp_path: Path) -> None:
    _pool, fd, offer = offered(tmp_path)
    here = node_pool.boot_id()
    assert node_pool.refusal(offer, here) is None
    assert node_pool.refusal(offer, "another-boot") is not None
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = dataclasses.replace(offer, pid=int(gone.stdout))
    assert "gone" in (node_pool.refusal(dead, here) or "")
    node_pool.publish(dataclasses.replace(offer, inode=offer.inode + 1), tmp_path)
    mapped, why = node_pool.attach("reader-1", tmp_path)
    assert mapped is None and "replaced" in why
    os.close(fd)


def test_a_withdrawn_offer_maps_nothing(tmp_path: Path) -> None:
    _pool, fd, _offer = offered(tmp_path)
    node_pool.withdraw(tmp_path / "reader-1.json")
    assert node_pool.attach("reader-1", tmp_path) == (None, "no pool published")
    os.close(fd)


def test_the_switch_and_the_offer_directory() -> None:
    assert node_pool.switched_off({node_pool.SWITCH: "0"})
    assert not node_pool.switched_off({})
    assert node_pool.offer_dir({"XDG_RUNTIME_DIR": "/nonexistent-dir"}).name.startswith(
        "kv-connector-node-pools-"
    )


def test_spans_are_copied_where_they_say() -> None:
    src = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    dst = torch.zeros(512, dtype=torch.uint8)
    done = node_pool.copy_spans(src, dst, np.array([[0, 100, 16], [200, 0, 8]]))
    assert done.query()
    assert dst[100:116].tolist() == list(range(16)) and dst[0:8].tolist() == list(range(200, 208))
    assert int(dst.count_nonzero()) == 16 + 8 - 1  # nothing else written (src[0] is 0)


@pytest.mark.parametrize("row", [[250, 0, 8], [0, 510, 8], [-1, 0, 1]])
def test_a_span_outside_its_memory_is_refused(row: list[int]) -> None:
    with pytest.raises(ValueError, match="outside"):
        node_pool.copy_spans(
            torch.zeros(256, dtype=torch.uint8), torch.zeros(512, dtype=torch.uint8), np.array([row])
        )


def test_a_permuted_dense_tensor_is_seen_as_its_bytes() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    permuted = base.permute(1, 0, 2)
    view = node_pool.byte_view(permuted)
    assert view.numel() == 24 * 4 and view.data_ptr() == base.data_ptr()
    assert torch.equal(view.view(torch.float32), base.reshape(-1))
