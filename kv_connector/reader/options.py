"""The options every client of the reader shares, declared, defaulted and checked once.

``ClientOptions`` is a msgspec Struct, as the producer's ``ConnectorOptions`` is. The push
reader's ``ReaderConfig``, the pull client's ``PullOptions`` and the fetch agent extend it.
So a pool, its device, the checks and the hand-out are named the same way whichever client
a user runs. A bad value raises ``ConfigurationError`` (a ``ValueError``) naming it when the record is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from kv_connector.common.errors import ConfigurationError
from kv_connector.wire.provenance import Expectation

# A client's receive pool holds the samples on their way and those on lease: the push
# reader's producers WRITE several at once, and a pull client's ``fetch_iter`` READs four
# ahead; 256 MiB holds four 64 MiB samples (4k tokens of 2 layers of 4096 in bf16).
DEFAULT_POOL_BYTES = 256 << 20
# A rank's fetch agent has one pool for every DataLoader worker of the rank.
AGENT_POOL_BYTES = 1 << 30


class ClientOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every client is configured with; each client adds its own fields.

    ``name``: the client's name at producers and in logs (default: a random one).
    ``pool_bytes``: the receive pool, registered with NIXL once. The samples on their way
    and those on lease share it.
    ``pool_device``: None (default) keeps the pool in host memory. ``"cuda:N"`` puts it on
    that GPU, registered as VRAM. Samples then land, are checked and are views there, and
    their pages return in stream order. ``"cpu"`` runs that device code on host memory,
    which is what CI tests. ``PoolDeviceError`` when CUDA or the GPU is missing.
    ``copy``: hand samples out as copies, into reused buffers, instead of views of the pool
    on lease. Their pages return at once. For users who keep samples for long.
    ``check_values`` (default on): refuse a sample whose states hold NaN/Inf, tokens zero in
    every layer or layers zero at every token (``reader.pool.values``). On a host pool it is
    a sampled screen, and the whole sample is looked at only where it shows something. On a
    GPU pool it is a full pass there. ``full_values_check`` reads every value on the host too.
    ``expect``: what every sample must be (``wire.provenance.Expectation``: layer ids,
    dtype, hidden size, model). One that differs is refused by name before its bytes move.
    """

    pool_bytes: int = DEFAULT_POOL_BYTES
    name: str | None = None
    pool_device: str | None = None
    copy: bool = False
    check_values: bool = True
    full_values_check: bool = False
    expect: Expectation | None = None

    def __post_init__(self) -> None:
        if self.pool_bytes <= 0:
            raise ConfigurationError(f"pool_bytes must be positive, got {self.pool_bytes}")
        # PoolDeviceError naming what is missing, before anything is made
        if self.pool_device is not None:
            # torch: only for a pool on a device
            from kv_connector.reader.pool.memory import device_of

            device_of(self.pool_device)


Options = TypeVar("Options", bound=ClientOptions)


def options_of(kind: type[Options], given: Options | None, keywords: Mapping[str, Any]) -> Options:
    """``given``, or a ``kind`` built of ``keywords``.

    A client takes its record or its fields as keywords; ``TypeError`` says so when it is
    handed both."""
    if given is None:
        return kind(**keywords)
    if keywords:
        raise TypeError(f"pass a {kind.__name__} or its fields as keywords, not both: {sorted(keywords)}")
    return given


__all__ = ["AGENT_POOL_BYTES", "DEFAULT_POOL_BYTES", "ClientOptions", "options_of"]
