"""Fault injection through the public seam: a ``Transport`` that delegates to a real
``NixlTransport`` and, on cue, lands wrong bytes or aims a WRITE at memory the reader
never registered. The sender and the reader take it as ``transport=``; everything else
(NIXL, UCX, the peer, its checks) stays real."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kv_connector.reader import HiddenStatesReader
from kv_connector.wire import protocol
from kv_connector.wire.transport import Region, Transfer, Transport

if TYPE_CHECKING:
    from collections.abc import Collection

UNREGISTERED = 1 << 40  # an offset past any region this machine registers


@dataclass
class _Delayed:
    """A WRITE held back, then posted for real by its timer (``posted``)."""

    nbytes: int
    peer: str
    posted: Transfer | None = None


class FaultyTransport:
    """A real transport with faults on cue.

    ``garble``: request ids whose WRITEs land wrong bytes: the last span's source is read
    one byte further on (a random cache then lands bytes that differ from the ones its
    checksum was computed over), as if the share were damaged on its way or in the pool.
    ``garble_times``: garble only the first so many WRITEs of each (None: every one).
    ``misaddress``: every WRITE is aimed past the reader's registered pool, so NIXL itself
    refuses it (no memory descriptor of the peer covers it).
    ``delay``: request id -> seconds its first WRITE stays in flight before it is posted
    to NIXL at all, by a timer whatever the sender does (the sender sees a WRITE posted
    and not complete; it lands that much later, as a WRITE stuck on a slow link would).
    ``garbled`` lists the request ids of the WRITEs garbled, in order; ``registered`` the
    tensors registered, in order (e.g. a reader's receive pool, to look at);
    ``peers_added`` the peers whose metadata it loaded (a reader: the producers it let in);
    ``landed`` the (peer, request id) of each WriteDone notification received (a WRITE
    landed), ``polls`` how many times it was polled for them (the batch one poll returned
    has been handled once the next poll starts).
    """

    def __init__(
        self,
        inner: Transport,
        *,
        garble: Collection[str] = (),
        garble_times: int | None = None,
        misaddress: bool = False,
        delay: dict[str, float] | None = None,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.garble = set(garble)
        self.garble_times = garble_times
        self.misaddress = misaddress
        self.delay = dict(delay or {})
        self.timers: list[threading.Timer] = []  # the delayed WRITEs' (join them before closing)
        self.garbled: list[str] = []
        self.registered: list[torch.Tensor] = []
        self.peers_added: list[str] = []
        self.landed: list[tuple[str, str]] = []
        self.polls = 0

    @property
    def metadata(self) -> bytes:
        return self.inner.metadata

    def register(self, tensor: torch.Tensor) -> Region:
        self.registered.append(tensor)
        return self.inner.register(tensor)

    def add_peer(self, metadata: bytes) -> str:
        peer = self.inner.add_peer(metadata)
        self.peers_added.append(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def write(
        self,
        peer: str,
        local: Region,
        remote: Region,
        spans: Sequence[tuple[int, int, int]] | np.ndarray,
        notif: bytes,
    ) -> Transfer:
        msg = protocol.decode(notif)
        rid = msg.request_id if isinstance(msg, protocol.WriteDone) else None
        if rid in self.garble and (self.garble_times is None or self.garbled.count(rid) < self.garble_times):
            rows = np.array(spans, dtype=np.int64).reshape(-1, 3)
            src, _, n = rows[-1]
            rows[-1, 0] = src + 1 if src + n < local.nbytes else src - 1
            spans = rows
            self.garbled.append(rid)
        if self.misaddress:
            remote = Region(remote.addr + UNREGISTERED, remote.nbytes, remote.mem_type, remote.device_id)
        wait = self.delay.pop(rid, None) if rid is not None else None
        if wait is not None:
            nbytes = int(np.asarray(spans, dtype=np.int64).reshape(-1, 3)[:, 2].sum())
            held = _Delayed(nbytes, peer)
            args = (peer, local, remote, spans, notif)
            timer = threading.Timer(wait, lambda: setattr(held, "posted", self.inner.write(*args)))
            timer.daemon = True
            timer.start()
            self.timers.append(timer)
            return held
        return self.inner.write(peer, local, remote, spans, notif)

    def poll(self, xfer: Transfer) -> bool:
        if isinstance(xfer, _Delayed):
            return xfer.posted is not None and self.inner.poll(xfer.posted)
        return self.inner.poll(xfer)

    def notifications(self) -> list[tuple[str, bytes]]:
        notes = self.inner.notifications()
        for peer, data in notes:
            with contextlib.suppress(Exception):
                msg = protocol.decode(data)
                if isinstance(msg, protocol.WriteDone):
                    self.landed.append((peer, msg.request_id))
        self.polls += 1
        return notes

    def close(self) -> None:
        self.inner.close()


def watched_reader(**options: Any) -> tuple[HiddenStatesReader, FaultyTransport]:
    """A reader on a real NIXL transport without faults, and that transport, which shows
    the receive pool it registered (``registered[0]``) and the producers let in."""
    from kv_connector.wire.nixl_transport import NixlTransport

    options.setdefault("name", f"reader-{uuid.uuid4().hex[:12]}")
    transport = FaultyTransport(NixlTransport(options["name"]))  # the agent named as the reader
    try:
        return HiddenStatesReader(transport=transport, **options), transport
    except BaseException:
        transport.close()
        raise
