"""What the reader's ledger (``ledger.py``) keeps and answers.

It holds the record of a sample and of each rank's share of it, the reader's options as
types, and the actions a shell performs (``Send``, ``CheckShare``, ``Ready``, ``Log``). A record
keeps itself consistent: its shares tile the sample, and it tracks each share's landings
and checksum. Its state moves as shares land and are checked, only through the table of
``sample_states.py``, whose states it names here too. What happens across samples is the
ledger's. Pure logic: no nixl, sockets, threads or clocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kv_connector.reader.pool.values import RowsScreen
from kv_connector.reader.push.producers import PeerId
from kv_connector.reader.push.sample_states import IllegalSampleTransition as IllegalSampleTransition
from kv_connector.reader.push.sample_states import SampleEvent, move
from kv_connector.reader.push.sample_states import SampleState as SampleState
from kv_connector.wire import protocol
from kv_connector.wire.protocol import ProtocolError, ShareChecksum

# (producer id, request id)
Key = tuple[str, str]


class RequireChecksum(enum.Enum):
    # from producers whose cache is in host memory (hashing it costs little)
    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class AckMode(enum.Enum):
    # the producer is acked when the sample is handed out
    ON_TAKE = "on_take"
    # when the user calls ``ack`` (e.g. once it is durably written)
    MANUAL = "manual"


@dataclass(frozen=True)
class Send:
    peer: PeerId
    msg: protocol.Message


@dataclass(frozen=True)
class CheckShare:
    """Check ``rank``'s share of a sample against ``checksum`` (its ``landing``), computed the
    way its producer computes them (``checksum``)."""

    key: Key
    rank: int
    landing: int
    checksum: int
    checksum_kind: ShareChecksum = ShareChecksum.XXH3


@dataclass(frozen=True)
class ShareToCheck:
    """Where a ``CheckShare``'s share lies in the pool: its sample's first byte, manifest and blocks."""

    base: int
    manifest: protocol.Manifest
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Ready:
    """A sample is complete and checked: queue it for the user."""

    key: Key


@dataclass(frozen=True)
class ReadySample:
    """A CHECKED sample as the user's thread hands it out.

    It holds its manifest, where its pages start in the pool (bytes), and each share's
    values screen (None: not screened)."""

    key: Key
    manifest: protocol.Manifest
    base: int
    screens: tuple[RowsScreen | None, ...]


@dataclass(frozen=True)
class Log:
    """Something worth a log line (the shell logs it at ``level``)."""

    level: str
    text: str


Action = Send | CheckShare | Ready | Log


@dataclass
class Share:
    """One rank's share of a sample, on the reader."""

    blocks: frozenset[int]
    peer: PeerId
    # how many times its WRITE landed (a Rewrite lands again)
    landing: int = 0
    landed: bool = False
    checksum: int | None = None
    # it landed saying its checksum follows
    checksum_due: bool = False
    # a LateChecksum that came before its WriteDone
    early_checksum: int | None = None
    checked: bool = False
    # the landing being checked
    checking: int | None = None
    # its rows' values screen, read with its check (fingerprints)
    screen: RowsScreen | None = None
    # sent a Grant or Rewrite, its WriteDone not come yet (a fence owed)
    in_flight: bool = False

    def land(self, msg: protocol.WriteDone) -> None:
        """Its WRITE landed (again): not checked yet; its checksum came with it, follows, or
        came before it (``early_checksum``). Each landing is numbered."""
        self.landing += 1
        self.landed, self.checked, self.checking, self.in_flight = True, False, None, False
        self.screen = None
        self.checksum, self.checksum_due = msg.checksum, msg.checksum_follows
        if msg.checksum_follows and self.early_checksum is not None:
            self.checksum, self.checksum_due, self.early_checksum = self.early_checksum, False, None

    def checksum_came(self, checksum: int) -> bool:
        """Its checksum arrived after its WRITE; True if it was due, and the share may be checked now.

        Else its WriteDone is still on its way, and the checksum is kept for it."""
        if self.landed and self.checksum_due:
            self.checksum, self.checksum_due = checksum, False
            return True
        self.early_checksum = checksum
        return False


@dataclass
class SampleRecord:
    key: Key
    manifest: protocol.Manifest
    world_size: int
    num_pages: int
    state: SampleState = SampleState.PROMISED
    # rank -> its share
    shares: dict[int, Share] = field(default_factory=dict)
    pages: range | None = None
    # of its grant of pages (0: none yet); every WRITE into them names it
    generation: int = 0
    rewrites: int = 0
    t_granted: float = 0.0
    t_handed_out: float = 0.0
    # its first credit request
    t_requested: float = 0.0

    @property
    def peers(self) -> dict[int, PeerId]:
        return {r: s.peer for r, s in self.shares.items()}

    def register(self, rank: int, peer: PeerId, blocks: frozenset[int], current: PeerId | None) -> bool:
        """Rank ``rank`` asks for the sample on connection ``peer`` (``current``: the
        connection the rank has now) promising ``blocks``. True for a new share; a rank that
        reconnected resends into the same pages. The ranks' shares must tile the sample's
        blocks; what does not fit is the producer's ``ProtocolError``."""
        rid, new = self.manifest.request_id, False
        share = self.shares.get(rank)
        if share is not None:
            if share.peer != peer and current == share.peer:
                raise ProtocolError(f"rank {rank} asked twice for {rid}")
            if share.blocks != blocks:
                raise ProtocolError(f"rank {rank} changed its share of {rid}")
            # the rank reconnected: it resends into the same pages
            share.peer = peer
        else:
            for r, other in self.shares.items():
                if blocks & other.blocks:
                    raise ProtocolError(f"ranks {r} and {rank} both promise blocks of {rid}")
            self.shares[rank] = Share(blocks, peer)
            new = True
        if len(self.shares) == self.world_size:
            covered = set().union(*(sh.blocks for sh in self.shares.values()))
            if len(covered) != self.manifest.num_blocks:
                raise ProtocolError(f"the ranks' shares of {rid} leave blocks unwritten")
        return new

    def advance(self, verify: bool, kind: ShareChecksum) -> list[Action]:
        """Check every share that landed with its checksum known (``CheckShare``), then move on.

        The checksum is computed the way ``kind`` says. With ``verify`` off, or no checksum,
        a share is checked as it lands. The sample is WRITTEN once every share landed, and
        CHECKED (``Ready``) once every share is checked."""
        if self.state not in (SampleState.GRANTED, SampleState.WRITTEN):
            return []
        actions: list[Action] = []
        for rank, share in self.shares.items():
            if not share.landed or share.checked or share.checking is not None:
                continue
            if not verify or (share.checksum is None and not share.checksum_due):
                # nothing to check it against
                share.checked = True
            elif share.checksum is not None:
                share.checking = share.landing
                actions.append(CheckShare(self.key, rank, share.landing, share.checksum, kind))
        if self.all_checked():
            move(self, SampleEvent.CHECKED)
            actions.append(Ready(self.key))
        elif self.all_landed() and self.state is SampleState.GRANTED:
            move(self, SampleEvent.LANDED)
        return actions

    def grant(self, rank: int | None = None) -> protocol.Grant:
        """The Grant of its pages, for ``rank`` (None: every rank registered).

        A WRITE of each rank that gets it is on its way until its WriteDone comes."""

        assert self.pages is not None and self.generation > 0
        for r, share in self.shares.items():
            if rank is None or r == rank:
                share.in_flight = bool(share.blocks)
        return protocol.Grant(
            request_id=self.key[1],
            first_page=self.pages.start,
            num_pages=len(self.pages),
            generation=self.generation,
        )

    def rewrite(self, rank: int) -> None:
        """``rank``'s share failed its check: GRANTED again until it lands anew."""
        move(self, SampleEvent.CHECK_FAILED)
        share = self.shares[rank]
        share.landed = share.checked = False
        share.in_flight = True

    def missing(self) -> list[int]:
        """The ranks whose share has not landed."""
        return sorted(r for r in range(self.world_size) if r not in self.shares or not self.shares[r].landed)

    def all_registered(self) -> bool:
        return len(self.shares) == self.world_size and self.pages is not None

    def all_landed(self) -> bool:
        return self.all_registered() and all(s.landed or not s.blocks for s in self.shares.values())

    def all_checked(self) -> bool:
        return self.all_landed() and all(s.checked or not s.blocks for s in self.shares.values())
