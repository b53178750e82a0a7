"""The pull ledger: every sample one rank holds for consumers to READ, as a state machine.

A sample lives here from the step that computed it to its release, expiry or end. Pure
logic: no nixl, sockets, threads or clocks; times are passed in. The shells feed it what
happened and do what it answers: the rank's pull endpoint (``producer.pull.server``) and
the worker side.

The states of a sample (``HoldState``: HELD, then how it ended), the events that move it,
and the table of its legal transitions are ``hold_states.py``'s. Every transition goes
through that table (``HOLDS.step``); an illegal one raises ``IllegalTransition``. A sample
that leaves HELD is remembered, boundedly, in its end state. So a late fetch or release is
answered with why ("expired", "released", ...), never with data.

Invariants (tests name the one they prove):
  P1  Data only while HELD: ``fetch`` returns a sample's record only while it is held,
      with its nonce, before its deadline; in every other case it raises ``PullRefused``
      with the reason, and returns nothing.
  P2  A wrong nonce is answered exactly as an unknown request ("unknown"): a forged or
      stale handle learns nothing, not even whether the request exists.
  P3  Every held sample leaves HELD exactly once (release, expiry, preemption, abort or
      close) and is then reported by ``take_freed`` exactly once: its blocks are given
      back to vLLM once, and never while a consumer may still be served from them.
  P4  A sample past its deadline is never served, whether or not ``expire`` ran since.
      The deadline runs from the request's finish (``finished``), when its handle goes
      out: a long generation does not eat a consumer's time.
  P5  What is remembered of ended samples is bounded (``remember``); a forgotten one
      answers "unknown".
  P6  A request is held at most once at a time: holding one already held is the shell's
      bug (``IllegalTransition``).
  P7  With a fence table (``producer.pull.hold_fences``), a hold's fence word holds its value
      exactly while it is HELD: it is written when it is held and zeroed in the same call
      that ends it, before ``take_freed`` can report it.
  P8  A consumer that says it is coming (``keep``: its fetch agent is still starting)
      moves a held sample's deadline to ``timeout_s`` from now, never earlier than it was
      and never later than ``KEEP_LIMIT`` times ``timeout_s`` after the request finished:
      a consumer that never comes cannot keep blocks for ever.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kv_connector.common.errors import ConfigurationError, RefusedError
from kv_connector.producer.pull.hold_fences import FenceTable
from kv_connector.producer.pull.hold_states import HOLDS, HoldEvent
from kv_connector.producer.pull.hold_states import HoldState as HoldState
from kv_connector.producer.pull.hold_states import IllegalTransition as IllegalTransition
from kv_connector.wire.protocol import Manifest, PullErrorCode

# ended samples remembered, to say why they are gone
REMEMBER = 4096
# a kept hold ends at most this many pull_timeout_s after its request finished
KEEP_LIMIT = 2.0


_WHY: dict[HoldState, str] = {
    HoldState.RELEASED: "was released already",
    HoldState.EXPIRED: "expired: not released within pull_timeout_s, its blocks were freed",
    HoldState.PREEMPTED: "was preempted by vLLM before it was fetched: its blocks hold another request now",
    HoldState.ABORTED: "was aborted",
    HoldState.CLOSED: "is gone: the producer shut down",
    HoldState.FAILED: "failed",
}


class PullRefused(RefusedError):
    """A fetch or release that gets no data: ``code`` says why (the wire's ``PullError``)."""

    def __init__(self, code: PullErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: PullErrorCode = code
        self.message = message


@dataclass
class Held:
    """A sample one rank holds.

    ``block_ids``: the cache blocks of all the sample's blocks, in order. ``share``: the
    range of them this rank serves. ``checksum``: the share's checksum once the shell computed
    it, lazily on the first fetch. ``fence``: its fence's (slot, value); None without a
    table or with the table full (P7)."""

    request_id: str
    nonce: str
    manifest: Manifest
    block_ids: list[int]
    share: range
    deadline: float
    checksum: int | None = None
    fetches: int = 0
    fence: tuple[int, int] | None = None
    # when its request finished (its clock started)
    finished_at: float = math.inf
    keeps: int = 0


class PullLedger:
    def __init__(self, timeout_s: float, remember: int = REMEMBER, fences: FenceTable | None = None) -> None:
        if not timeout_s > 0:
            raise ConfigurationError(f"pull_timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.remember = remember
        self._held: dict[str, Held] = {}
        # request id -> (nonce, how its hold ended, why)
        self._ended: OrderedDict[str, tuple[str, HoldState, str]] = OrderedDict()
        self._freed: set[str] = set()
        # fetches answered with data
        self.served = 0
        self.fences = fences

    # ------------------------------------------------------------- producer side
    def hold(
        self, request_id: str, nonce: str, manifest: Manifest, block_ids: list[int], share: range, now: float
    ) -> None:
        """The step computed the sample: hold it for ``timeout_s`` (P6)."""
        HOLDS.step(
            HoldState.HELD if request_id in self._held else None, HoldEvent.HOLD, f"request {request_id}"
        )
        # a new sample: how an earlier one ended is forgotten
        self._ended.pop(request_id, None)
        fence = self.fences.open() if self.fences is not None else None
        self._held[request_id] = Held(
            request_id, nonce, manifest, list(block_ids), share, math.inf, fence=fence
        )

    def finished(self, request_ids: Iterable[str], now: float) -> None:
        """These requests finished (their handles are out): their clocks start (P4)."""
        for rid in request_ids:
            h = self._held.get(rid)
            if h is not None and h.deadline == math.inf:
                h.deadline = now + self.timeout_s
                h.finished_at = now

    def fail(self, request_id: str, nonce: str, why: str) -> None:
        """The sample could not be held (``why``): a fetch says so."""
        if request_id in self._held:
            self._end(request_id, HoldEvent.FAIL, why)
        else:
            self._remember(request_id, nonce, HOLDS.step(None, HoldEvent.FAIL), why)

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def expire(self, now: float) -> list[str]:
        """Samples past their deadline end (P3, P4); returns their request ids (to log)."""
        gone = [rid for rid, h in self._held.items() if now >= h.deadline]
        for rid in gone:
            self._end(rid, HoldEvent.EXPIRE)
        return gone

    def preempt(self, request_ids: Iterable[str]) -> list[str]:
        """vLLM is about to reuse these requests' blocks: the held ones end (P1, P3)."""
        return self._end_all(request_ids, HoldEvent.PREEMPT)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """These requests were aborted: the held ones end."""
        return self._end_all(request_ids, HoldEvent.ABORT)

    def close(self) -> list[str]:
        """The engine shuts down: every held sample ends."""
        return self._end_all(list(self._held), HoldEvent.CLOSE)

    def take_freed(self) -> set[str]:
        """Samples that left HELD since the last call, each once (P3)."""
        out, self._freed = self._freed, set()
        return out

    def holding(self, request_id: str) -> Held | None:
        """The record of a sample held now (whatever its clock says), or None."""
        return self._held.get(request_id)

    # ------------------------------------------------------------- consumer side
    def check(self, request_id: str, nonce: str, now: float) -> Held:
        """The sample's record while it is held (P1, P2, P4), without serving it."""
        return self._live(request_id, nonce, now)

    def fetch(self, request_id: str, nonce: str, now: float) -> Held:
        """The sample's record for a consumer holding its handle (P1, P2, P4)."""
        h = self._live(request_id, nonce, now)
        h.fetches += 1
        self.served += 1
        return h

    def keep(self, request_id: str, nonce: str, now: float) -> float:
        """A consumer holding the handle is coming (P8): the seconds the sample stays held from ``now``.

        One whose request has not finished gets ``timeout_s``, since its clock has not
        started. ``PullRefused`` as ``fetch`` for one not held."""
        h = self._live(request_id, nonce, now)
        h.keeps += 1
        if h.finished_at == math.inf:
            return self.timeout_s
        limit = h.finished_at + KEEP_LIMIT * self.timeout_s
        h.deadline = max(h.deadline, min(now + self.timeout_s, limit))
        return h.deadline - now

    def release(self, request_id: str, nonce: str, now: float) -> None:
        """The consumer is done with the sample: it ends (P3). Releasing one that
        expired, or releasing twice, raises ``PullRefused`` saying so."""
        self._live(request_id, nonce, now)
        self._end(request_id, HoldEvent.RELEASE)

    def set_checksum(self, request_id: str, nonce: str, value: int) -> None:
        h = self._held.get(request_id)
        if h is not None and h.nonce == nonce:
            h.checksum = value

    # ------------------------------------------------------------------ helpers
    def _live(self, request_id: str, nonce: str, now: float) -> Held:
        h = self._held.get(request_id)
        if h is not None and h.nonce == nonce:
            if now < h.deadline:
                return h
            self._end(request_id, HoldEvent.EXPIRE)
        ended = self._ended.get(request_id)
        if ended is not None and ended[0] == nonce:
            _, state, why = ended
            raise PullRefused(state.value, f"sample {request_id} {why}")  # type: ignore[arg-type]
        raise PullRefused("unknown", f"this producer holds no sample {request_id} under that handle")

    def _end_all(self, request_ids: Iterable[str], event: HoldEvent) -> list[str]:
        gone = [rid for rid in request_ids if rid in self._held]
        for rid in gone:
            self._end(rid, event)
        return gone

    def _end(self, request_id: str, event: HoldEvent, why: str = "") -> None:
        """A held sample ends: HELD -> where ``event`` leads (P3)."""
        state = HOLDS.step(HoldState.HELD, event, f"request {request_id}")
        h = self._held.pop(request_id)
        if h.fence is not None and self.fences is not None:
            # before anyone may give its blocks back (P7)
            self.fences.close(h.fence[0])
        self._freed.add(request_id)
        self._remember(request_id, h.nonce, state, why or _WHY[state])

    def _remember(self, request_id: str, nonce: str, state: HoldState, why: str) -> None:
        self._ended[request_id] = (nonce, state, why)
        self._ended.move_to_end(request_id)
        while len(self._ended) > self.remember:
            self._ended.popitem(last=False)

    def __len__(self) -> int:
        return len(self._held)

    def held_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self._held.values())
