"""Builders of sender ledgers, jobs, grants and credits shared by the sender's unit tests."""

from __future__ import annotations

from kv_connector.sender.job_states import JobState
from kv_connector.sender.ledger import SendLedger
from kv_connector.wire import protocol
from kv_connector.wire.layout import BlockLayout, stripe

LAYOUT = BlockLayout("LTH", 16, 2, 8, "float32")
PAGE = LAYOUT.block_bytes
POOL = 64 * PAGE


def manifest(rid: str, n: int = 40) -> protocol.Manifest:
    return protocol.Manifest(
        request_id=rid,
        token_ids=list(range(n)),
        layer_ids=[1, 2],
        geometry=LAYOUT,
        num_blocks=LAYOUT.blocks_for(n),
    )


def ledger(checksum: bool = False, **kw: float) -> SendLedger:
    return SendLedger(checksum=checksum, connect_timeout_s=kw.get("timeout", 10.0), retry_backoff_s=0.2)


def submit(led: SendLedger, rid: str, n: int = 40, rank: int = 0, world: int = 1, t: float = 0.0) -> None:
    m = manifest(rid, n)
    led.submit(rid, m, list(range(10, 10 + m.num_blocks)), stripe(m.num_blocks, rank, world), t)


def grant(rid: str, n_pages: int = 3, first: int = 0, generation: int = 5) -> protocol.Grant:
    return protocol.Grant(request_id=rid, first_page=first, num_pages=n_pages, generation=generation)


def to_granted(led: SendLedger, rid: str, t: float = 1.0, pages: int = 3) -> None:
    led.requests_due()
    assert led.state_of(rid) is JobState.REQUESTED
    led.on_grant(grant(rid, pages), PAGE, POOL, t)


def to_writing(led: SendLedger, rid: str, t: float = 1.0) -> None:
    to_granted(led, rid, t)
    (job,) = led.writes_due(t)
    post(led, rid, t)
    assert led.state_of(rid) is JobState.WRITING and job.request_id == rid


def post(led: SendLedger, rid: str, t: float, xfer: object = None) -> protocol.WriteDone:
    notif = led.notification(rid)
    led.write_posted(rid, xfer if xfer is not None else object(), t, notif)
    return notif


def credit(generation: int, first: int = 0, pages: int = 3) -> protocol.Credit:
    return protocol.Credit(generation=generation, first_page=first, num_pages=pages)


def held(led: SendLedger, *credits: protocol.Credit) -> None:
    for c in credits:
        led.on_credit(c, PAGE, POOL)
