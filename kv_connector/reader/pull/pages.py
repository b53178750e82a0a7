"""The pull client's room in its receive pool: a run of pages for a sample, waited for
while the samples on lease hold the pool (their pages come back as they are released,
collected, or their GPU work ends), up to the client's timeout."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Hashable

from kv_connector.reader.pool.memory import PoolMemory
from kv_connector.reader.pool.pages import PagePool, PoolTooSmall
from kv_connector.reader.pull.links import FetchError

RETRY_S = 0.002  # between two looks at a full pool


def take_pages(
    memory: PoolMemory,
    pool: PagePool,
    lock: threading.Lock,
    key: Hashable,
    n: int,
    request_id: str,
    timeout_s: float,
    pool_bytes: int,
) -> range:
    """``n`` pages of ``pool`` for the sample ``key`` (``request_id`` names it in errors),
    each try made and cancelled under ``lock``; ``FetchError`` ("pool") when the pool can
    never hold it, the sample is being fetched already, or no room came in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    collected = False
    while True:
        memory.lease_fences.settle()  # leases whose GPU work is done give their pages back
        with lock:
            try:
                pool.request(key, n)
            except PoolTooSmall as e:
                raise FetchError("pool", f"{e} (PullClient pool_bytes={pool_bytes})") from None
            except ValueError as e:
                raise FetchError("pool", f"sample {request_id} is being fetched already: {e}") from None
            # nobody else waits (each request is made and cancelled under the lock)
            got = dict(pool.grantable())
            if key in got:
                return got[key]
            pool.cancel(key)
        if time.monotonic() >= deadline:
            raise FetchError(
                "pool",
                f"no room for sample {request_id} in the pool for {timeout_s:.0f} s: release the "
                "samples you hold (sample.release(), or drop their tensors), or raise pool_bytes",
            )
        if not collected:
            gc.collect()  # leases whose tensors are only in reference cycles
            collected = True
        time.sleep(RETRY_S)


__all__ = ["take_pages"]
