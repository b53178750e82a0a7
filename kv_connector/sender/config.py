"""Where and as whom a rank ships: the sender's settings, checked when built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kv_connector.common.errors import ConfigurationError
from kv_connector.wire.protocol import MAX_CREDITS_AHEAD, ShareChecksum
from kv_connector.wire.provenance import Provenance

# two samples' pages ahead: the next sample's, and one to spare
CREDITS_AHEAD = 2


@dataclass(frozen=True)
class SenderConfig:
    """Where and as whom a rank ships.

    consumer_address: the reader's control address, ``HOST:PORT``.
    producer_id: shared by all ranks of one producer engine, unique among producers.
    rank / world_size: this rank and how many ranks share each sample's blocks.
    connect_timeout_s: how long to keep trying to reach the reader.
    checksum: how each share's checksum, sent with its WRITE for the reader to check, is
    computed: ``XXH3`` over the share's bytes (on a GPU cache this stages them to host
    memory once), ``BLOCKS`` from per-block digests where the cache is (``block_digest``:
    torch ops on a stream of their own, 8 bytes per block to the host; the way for a GPU
    cache, whose rows must be whole 8-byte words); None sends none.
    sample_timeout_s: a sample granted pages and not acknowledged this long after fails
    (and the reader is told), whatever the connection does.
    on_outcome: called on the sender's thread when the reader acknowledged or refused a
    sample (``take_finished`` / ``take_failed`` have news); it must not block.
    credits_ahead: runs of pages a producer of one rank asks the reader to grant ahead of
    its samples, so that each goes out without a credit round trip (``protocol.Credit``);
    0 asks for none. Ranks of a larger world ask for none: they must write the same pages.
    """

    consumer_address: str
    producer_id: str
    rank: int = 0
    world_size: int = 1
    connect_timeout_s: float = 60.0
    checksum: ShareChecksum | None = ShareChecksum.XXH3
    sample_timeout_s: float = 300.0
    on_outcome: Callable[[], None] | None = None
    # what produced the samples, in every manifest
    provenance: Provenance | None = None
    credits_ahead: int = CREDITS_AHEAD

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigurationError(f"rank {self.rank} outside world size {self.world_size}")
        if self.connect_timeout_s <= 0 or self.sample_timeout_s <= 0:
            raise ConfigurationError("connect_timeout_s and sample_timeout_s must be positive")
        if not 0 <= self.credits_ahead <= MAX_CREDITS_AHEAD:
            raise ConfigurationError(
                f"credits_ahead must be 0 to {MAX_CREDITS_AHEAD}, got {self.credits_ahead}"
            )
