"""Keeps a producer's holds for a consumer that is still starting.

A sample handed out before the fetch agent serves must not be freed by ``pull_timeout_s``
meanwhile. While a trainer rank's fetch agent starts
(``agent.client.FetchAgentProcess.start(keep=...)``), a thread tells each producer rank
the handles name that a consumer is coming (``PullKeep``). It says so again before the hold
would end. Each rank keeps a hold at most twice ``pull_timeout_s`` after its request
finished (its ledger's P8), so a consumer that never comes cannot keep blocks for ever.

No NIXL agent is needed. The keeper's connections are ``pull.links.ProducerLinks`` without
a transport: they run the authenticated handshake, announce the pool the agent will have
and move no memory key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kv_connector.reader.pull.links import PAGE_BYTES, FetchError, ProducerLinks
from kv_connector.wire import protocol
from kv_connector.wire.handle import HandleError, PullHandle, decode_handle, handle_of
from kv_connector.wire.transport import Region

log = logging.getLogger(__name__)

# keep a hold again once this share of what the producer granted has passed
KEEP_AGAIN = 0.4
# and never more often than this
MIN_KEEP_S = 0.5


@dataclass
class KeptHolds:
    """What a keeper did.

    ``kept``: keeps each producer rank answered. ``held_s``: the seconds the last answer
    granted per handle, from when it came. ``refused``: the handles a rank would not keep,
    and why; the fetch will say the same."""

    kept: int = 0
    held_s: dict[str, float] = field(default_factory=dict)
    refused: dict[str, FetchError] = field(default_factory=dict)


class HoldKeeper:
    """Keeps the holds of ``handles`` (or responses' ``kv_transfer_params``) from ``start()`` to ``stop()``.

    It speaks as the consumer to come: named ``name``, with a pool of ``pool_bytes``."""


    def __init__(
        self,
        handles: Iterable[str | Mapping[str, Any]],
        name: str,
        pool_bytes: int,
        secret: bytes | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.handles: list[PullHandle] = []
        for h in handles:
            try:
                self.handles.append(decode_handle(handle_of(h)))
            except HandleError:
                # not a handle: the fetch says so
                continue
        self.name = name
        pages = max(1, pool_bytes // PAGE_BYTES)
        self._links = ProducerLinks(
            name, secret, timeout_s, threading.Lock(), None, Region(0, pages * PAGE_BYTES, "DRAM", 0)
        )
        self.report = KeptHolds()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hold-keeper", daemon=True)

    def start(self) -> HoldKeeper:
        if self.handles:
            self._thread.start()
        return self

    def stop(self) -> KeptHolds:
        """Stop keeping (the consumer is here, or gave up); what was kept."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._links.close()
        return self.report

    def __enter__(self) -> HoldKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        # when each handle is kept next
        due = {i: 0.0 for i in range(len(self.handles))}
        while due and not self._stop.is_set():
            now = time.monotonic()
            for i in [i for i, t in due.items() if t <= now]:
                granted = self._keep(self.handles[i])
                if granted is None:
                    del due[i]
                else:
                    due[i] = time.monotonic() + max(MIN_KEEP_S, KEEP_AGAIN * granted)
            if due:
                self._stop.wait(max(0.0, min(due.values()) - time.monotonic()))

    def _keep(self, handle: PullHandle) -> float | None:
        """Keep one handle's hold at every rank; the least any rank granted, None once a
        rank refused (or cannot be reached)."""
        least: float | None = None
        for rank, endpoint in enumerate(handle.endpoints):
            msg = protocol.PullKeep(request_id=handle.request_id, nonce=handle.nonce)
            try:
                got = self._links.ask(handle, rank, endpoint, msg)
            except FetchError as e:
                self._refused(handle, e)
                return None
            if not isinstance(got, protocol.PullKept):
                why = got.message if isinstance(got, protocol.PullError) else f"answered {type(got).__name__}"
                code = got.code if isinstance(got, protocol.PullError) else "protocol"
                self._refused(handle, FetchError(code, f"rank {rank}: {why}"))
                return None
            self.report.kept += 1
            least = got.held_s if least is None else min(least, got.held_s)
        if least is not None:
            self.report.held_s[handle.request_id] = least
        return least

    def _refused(self, handle: PullHandle, error: FetchError) -> None:
        log.warning("cannot keep sample %s held while the fetch agent starts: %s", handle.request_id, error)
        self.report.refused[handle.request_id] = error
        return None


__all__ = ["HoldKeeper", "KeptHolds"]
