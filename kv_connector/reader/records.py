"""What the reader's ledger (``ledger.py``) keeps and answers: the record of a sample
and of each rank's share of it, the sample's states, the reader's options as types, and
the actions a shell performs (``Send``, ``Verify``, ``Ready``, ``Log``). Pure data: no
nixl, sockets, threads or clocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kv_connector.reader.producers import PeerId
from kv_connector.wire import protocol
from kv_connector.wire.protocol import ShareChecksum

Key = tuple[str, str]  # (producer id, request id)


class IllegalSampleTransition(RuntimeError):
    """A shell asked for a transition the sample's state does not allow."""


class SampleState(enum.Enum):
    PROMISED = "promised"
    GRANTED = "granted"
    WRITTEN = "written"
    VERIFIED = "verified"
    HANDED_OUT = "handed_out"


class RequireChecksum(enum.Enum):
    AUTO = "auto"  # from producers whose cache is in host memory (hashing it costs little)
    ALWAYS = "always"
    NEVER = "never"


class AckMode(enum.Enum):
    ON_TAKE = "on_take"  # the producer is acked when the sample is handed out
    MANUAL = "manual"  # when the user calls ``ack`` (e.g. once it is durably written)


@dataclass(frozen=True)
class Send:
    peer: PeerId
    msg: protocol.Message


@dataclass(frozen=True)
class Verify:
    """Check ``rank``'s share of a sample against ``digest`` (its ``landing``), computed the
    way its producer computes them (``checksum``)."""

    key: Key
    rank: int
    landing: int
    digest: int
    checksum: ShareChecksum = ShareChecksum.XXH3


@dataclass(frozen=True)
class Ready:
    """A sample is complete and checked: queue it for the user."""

    key: Key


@dataclass(frozen=True)
class Log:
    """Something worth a log line (the shell logs it at ``level``)."""

    level: str
    text: str


Action = Send | Verify | Ready | Log


@dataclass
class Share:
    """One rank's share of a sample, on the reader."""

    blocks: frozenset[int]
    peer: PeerId
    landing: int = 0  # how many times its WRITE landed (a Rewrite lands again)
    landed: bool = False
    digest: int | None = None
    digest_due: bool = False  # it landed saying its digest follows
    early_digest: int | None = None  # a ShareDigest that came before its WriteDone
    checked: bool = False
    checking: int | None = None  # the landing being checked


@dataclass
class SampleRecord:
    key: Key
    manifest: protocol.Manifest
    world_size: int
    num_pages: int
    state: SampleState = SampleState.PROMISED
    shares: dict[int, Share] = field(default_factory=dict)  # rank -> its share
    pages: range | None = None
    rewrites: int = 0
    t_granted: float = 0.0
    t_handed_out: float = 0.0
    t_requested: float = 0.0  # its first credit request

    @property
    def peers(self) -> dict[int, PeerId]:
        return {r: s.peer for r, s in self.shares.items()}

    def all_registered(self) -> bool:
        return len(self.shares) == self.world_size and self.pages is not None

    def all_landed(self) -> bool:
        return self.all_registered() and all(s.landed or not s.blocks for s in self.shares.values())

    def all_checked(self) -> bool:
        return self.all_landed() and all(s.checked or not s.blocks for s in self.shares.values())
