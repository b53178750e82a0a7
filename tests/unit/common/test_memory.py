"""Host memory for transfer buffers (``common.memory``): zeroed, writable, the size asked
for, alive as long as the array is, whatever the kernel's huge-page setting."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from kv_connector.common.memory import HUGE_PAGE_BYTES, host_memory


@pytest.mark.parametrize("nbytes", [1, 4096, HUGE_PAGE_BYTES - 1, HUGE_PAGE_BYTES, 3 * HUGE_PAGE_BYTES + 123])
def test_host_memory_is_zeroed_writable_and_of_the_size_asked(nbytes: int) -> None:
    buf = host_memory(nbytes)
    assert buf.dtype == np.uint8 and buf.shape == (nbytes,) and buf.flags.writeable
    assert not buf.any()
    buf[:] = 7
    t = torch.from_numpy(buf)  # how the pools use it: a tensor over the same bytes
    assert int(t.sum()) == 7 * nbytes


def test_the_mapping_lives_as_long_as_the_array() -> None:
    buf = host_memory(2 * HUGE_PAGE_BYTES)
    view = torch.from_numpy(buf[HUGE_PAGE_BYTES:])
    del buf
    gc.collect()
    view.fill_(3)  # the pages are still mapped: no crash, the values are there
    assert int(view[-1]) == 3 and int(view.sum()) == 3 * HUGE_PAGE_BYTES
