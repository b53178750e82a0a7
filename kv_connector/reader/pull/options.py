"""A pull client's options: the ones every client shares, and pull's own.

One record that a ``PullClient``, a rank's fetch agent and the agent's configuration line
all take."""

from __future__ import annotations

from typing import Annotated

import msgspec

from kv_connector.reader.options import DEFAULT_POOL_BYTES, ClientOptions, PositiveSeconds
from kv_connector.reader.pull.links import PAGE_BYTES

FETCH_TIMEOUT_S = 60.0


class PullOptions(ClientOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a ``PullClient`` pools, checks and hands out.

    It holds the options every client shares (``reader.options.ClientOptions``) and pull's own.
    ``timeout_s``: how long one fetch may take, connecting and reading included.
    ``shared_pool``: the host pool in a memory file other processes map (``pool_fd``). A
    rank's fetch agent serves its DataLoader workers from it (``reader.agent.fetch_agent``).

    A GPU pool (``pool_device="cuda:N"``) whose NIXL cannot register GPU memory is named at
    the first fetch, when the pool is made. A sample that differs from ``expect`` fails its
    fetch with ``FetchError("mismatch")`` before it is READ, and its producer frees it.
    """

    # at least one page
    pool_bytes: Annotated[int, msgspec.Meta(ge=PAGE_BYTES)] = DEFAULT_POOL_BYTES
    timeout_s: PositiveSeconds = FETCH_TIMEOUT_S
    shared_pool: bool = False


__all__ = ["FETCH_TIMEOUT_S", "PullOptions"]
