"""What the sender and the reader need of a transport, as a ``typing.Protocol``: one
agent that registers memory once, knows its peers by their metadata, posts one-sided
WRITEs with a notification, and is polled for progress. ``nixl_transport.NixlTransport``
(NIXL over UCX) is the implementation, and the only module that imports nixl; the
shells take any ``Transport`` as a parameter. Pure declarations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from kv_connector.common.errors import WireError

if TYPE_CHECKING:
    import numpy as np
    import torch

MemType = Literal["DRAM", "VRAM"]


class TransportError(WireError):
    """The transport refused an operation or a transfer failed."""


@dataclass(frozen=True)
class Region:
    """A registered memory region."""

    addr: int
    nbytes: int
    mem_type: MemType
    device_id: int


class Transfer(Protocol):
    """A posted WRITE: how many bytes, to whom."""

    nbytes: int
    peer: str


class Transport(Protocol):
    """One transfer agent."""

    name: str

    @property
    def metadata(self) -> bytes:
        """This agent's metadata (connection info and memory keys) for a peer's ``add_peer``."""
        ...

    def register(self, tensor: torch.Tensor) -> Region:
        """Register a dense tensor's memory once (no copy)."""
        ...

    def deregister(self, region: Region) -> None:
        """Release a registration (before its memory is freed or remapped)."""
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent's metadata; returns its name."""
        ...

    def remove_peer(self, peer: str) -> None: ...

    def write(
        self,
        peer: str,
        local: Region,
        remote: Region,
        spans: Sequence[tuple[int, int, int]] | np.ndarray,
        notif: bytes,
    ) -> Transfer:
        """Post one WRITE of (local offset, remote offset, length) rows, with ``notif``
        delivered to the peer after the data landed."""
        ...

    def read(
        self,
        peer: str,
        local: Region,
        remote: Region,
        spans: Sequence[tuple[int, int, int]] | np.ndarray,
    ) -> Transfer:
        """Post one READ of (local offset, remote offset, length) rows from the peer's
        ``remote`` region into ``local`` (pull delivery)."""
        ...

    def poll(self, xfer: Transfer) -> bool:
        """True once the WRITE (or READ) completed; raises ``TransportError`` if it failed."""
        ...

    def notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as (peer name, message); also makes progress."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class PublishesPool(Protocol):
    """A transport that can offer a host pool in a memory file to producers on its node
    (``nixl_transport.NixlTransport``; ``wire.node_pool``)."""

    def publish_pool(self, region: Region, fd: int) -> None: ...
