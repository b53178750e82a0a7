"""Builders of reader ledgers, producer messages and sample states shared by the push unit tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from kv_connector.reader.push.ledger import LedgerConfig, ReaderLedger
from kv_connector.reader.push.records import CheckShare, Ready, SampleState, Send
from kv_connector.wire import protocol
from kv_connector.wire.layout import BlockLayout, stripe

LAYOUT = BlockLayout("LTH", 16, 2, 8, "float32")
PAGE = LAYOUT.block_bytes


def hello(pid: str = "p", rank: int = 0, world: int = 1, mem: str = "DRAM") -> protocol.Hello:
    return protocol.Hello(
        cache_mem=mem,  # type: ignore[arg-type]
        version=protocol.PROTOCOL_VERSION,
        producer_id=pid,
        rank=rank,
        world_size=world,
        agent_name=f"{pid}-{rank}",
        block_bytes=PAGE,
        nonce=bytes(32),
    )


def manifest(rid: str, n: int = 40, bs: int = LAYOUT.block_size) -> protocol.Manifest:
    g = msgspec.structs.replace(LAYOUT, block_size=bs)
    return protocol.Manifest(
        request_id=rid, token_ids=list(range(n)), layer_ids=[1, 2], geometry=g, num_blocks=g.blocks_for(n)
    )


def credit(rid: str, n: int = 40, rank: int = 0, world: int = 1) -> protocol.CreditRequest:
    m = manifest(rid, n)
    return protocol.CreditRequest(manifest=m, blocks=list(stripe(m.num_blocks, rank, world)))


def ledger(
    pages: int = 8, already_delivered: Callable[[str, str], bool] | None = None, **kw: Any
) -> ReaderLedger:
    led = ReaderLedger(LedgerConfig(**kw), already_delivered)
    led.set_pages(PAGE, pages)
    return led


def sends(actions: list[object], kind: type) -> list[tuple[int, protocol.Message]]:
    return [(a.peer, a.msg) for a in actions if isinstance(a, Send) and isinstance(a.msg, kind)]


def readies(actions: list[object]) -> list[tuple[str, str]]:
    return [a.key for a in actions if isinstance(a, Ready)]


def connected(led: ReaderLedger, *peers: tuple[int, protocol.Hello]) -> None:
    for peer, h in peers:
        led.peer_ready(peer, h)


def checks(actions: list[object]) -> list[CheckShare]:
    return [a for a in actions if isinstance(a, CheckShare)]


def check_all(led: ReaderLedger, actions: list[object], ok: bool = True) -> list[object]:
    """Carry out every CheckShare of ``actions`` (as the checking thread would), with ``ok``."""
    out: list[object] = []
    for v in checks(actions):
        out += led.share_checked(v.key, v.rank, v.landing, ok, 0.0)
    return out


def done(led: ReaderLedger, peer: int, rid: str, **kw: object) -> protocol.WriteDone:
    """The WriteDone of ``peer``'s WRITE into the sample's grant (generation 1 if none)."""
    ident = led.view.identity(peer)
    generation = (led.view.generation_of((ident[0], rid)) if ident is not None else None) or 1
    return protocol.WriteDone(request_id=rid, generation=generation, **kw)  # type: ignore[arg-type]


def land(led: ReaderLedger, peer: int, rid: str, checksum: int | None = 5) -> list[object]:
    """A share's WRITE lands with ``checksum``; its check (if any) passes."""
    actions = list(led.write_done(peer, done(led, peer, rid, checksum=checksum)))
    return actions + check_all(led, actions)


def written(led: ReaderLedger, rid: str = "a", n: int = 40) -> tuple[str, str]:
    """One producer (peer 1) whose sample ``rid`` has landed: WRITTEN, its check due."""
    connected(led, (1, hello()))
    led.credit_request(1, credit(rid, n), 0.0)
    (v,) = checks(led.write_done(1, done(led, 1, rid, checksum=5)))
    assert (v.key, v.rank, v.landing, v.checksum) == (("p", rid), 0, 1, 5)
    assert led.view.state_of(("p", rid)) is SampleState.WRITTEN
    return ("p", rid)


def checked_sample(led: ReaderLedger, rid: str = "a", n: int = 40) -> tuple[str, str]:
    """One producer (peer 1) whose sample ``rid`` is CHECKED, ready for the user."""
    connected(led, (1, hello()))
    led.credit_request(1, credit(rid, n), 0.0)
    assert readies(land(led, 1, rid)) == [("p", rid)]
    return ("p", rid)


def hand_out(led: ReaderLedger, key: tuple[str, str], now: float = 0.0) -> list[object]:
    got = led.hand_out(key, now)
    assert got is not None
    return list(got[1])
