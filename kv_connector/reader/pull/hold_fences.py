"""The pull client's side of hold fences (``producer.pull.hold_fences``): one READ of each share's fence word.

Once a sample's data READs completed, one 8-byte READ per share copies its hold's fence
word into a word of the client's own: host memory, registered beside the pool. The word
still holding the value the share named means the hold was live after the last byte
landed. So vLLM cannot have reused the blocks while they were read, and the consumer's
release needs no answer. A share whose word changed names its rank, and the client asks
it how the hold ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from kv_connector.common.errors import IntegrityError
from kv_connector.reader.pull.links import FetchError, ProducerLinks
from kv_connector.wire.handle import PullHandle
from kv_connector.wire.protocol import PullError, PullRelease, PullShare
from kv_connector.wire.transport import Region, Transfer, Transport, TransportError

# fence READs in flight at once (the client's checking threads')
FENCE_WORDS = 256
POLL_S = 0.00002
# The fence READs are polled this long under the lock they were posted under before it is
# let go: the lock guards the agent, and a fetch's data READ holds it while it copies (some
# 10 ms for 64 MiB by UCX's shared memory), so each poll taken apart waited that long. An
# 8-byte READ ends in a few hundred microseconds (the producer's progress serves it).
HOLD_POLL_S = 0.002


# a fence READ in flight and its share
Posted = tuple[Transfer, PullShare]


class HoldFenceStale(IntegrityError):
    """A fence READ failed or its word no longer held its value: ``ranks`` say where."""

    def __init__(self, ranks: list[int], why: str) -> None:
        super().__init__(why)
        self.ranks = ranks


class HoldFenceReader:
    """READs fence words through ``transport`` (its calls made under ``lock``, the
    client's: it guards the agent)."""

    def __init__(self, transport: Transport, lock: threading.Lock, words: int = FENCE_WORDS) -> None:
        self._transport = transport
        self._lock = lock
        self._words = torch.zeros(words, dtype=torch.int64)
        self._region = transport.register(self._words)
        self._free = list(range(words))
        self._slots = threading.Condition(threading.Lock())

    def check(self, reads: Sequence[tuple[str, PullShare]], deadline: float) -> None:
        """READ each (peer agent, share)'s fence word and compare.

        ``HoldFenceStale`` names the ranks whose hold ended or whose READ failed;
        ``TimeoutError`` past ``deadline``."""
        slots = self._take(len(reads), deadline)
        try:
            failed: list[int] = []
            waiting = []
            # one hold for the posts and their first polls (see HOLD_POLL_S)
            with self._lock:
                for slot, (peer, s) in zip(slots, reads, strict=True):
                    f = s.fence
                    assert f is not None
                    remote = Region(f.table_addr, f.table_bytes, "DRAM", 0)
                    try:
                        span = [(8 * slot, f.offset, 8)]
                        waiting.append((self._transport.read(peer, self._region, remote, span), s))
                    except TransportError:
                        failed.append(s.rank)
                until = time.monotonic() + HOLD_POLL_S
                while waiting:
                    waiting = self._poll(waiting, failed)
                    if not waiting or time.monotonic() >= until:
                        break
            # every posted READ ends before its word is reused
            while waiting:
                time.sleep(POLL_S)
                with self._lock:
                    waiting = self._poll(waiting, failed)
                if waiting and time.monotonic() >= deadline:
                    raise TimeoutError("a fence READ did not complete")
            if failed:
                raise HoldFenceStale(failed, "its fence READ failed")
            stale = [
                s.rank
                for slot, (_, s) in zip(slots, reads, strict=True)
                if s.fence is not None and int(self._words[slot]) & ((1 << 64) - 1) != s.fence.value
            ]
            if stale:
                raise HoldFenceStale(stale, "its hold ended before the READ completed")
        finally:
            self._give(slots)

    def _poll(self, waiting: list[Posted], failed: list[int]) -> list[Posted]:
        """Poll each READ once (call with the lock held): those still in flight."""
        left = []
        for x, s in waiting:
            try:
                if not self._transport.poll(x):
                    left.append((x, s))
            except TransportError:
                failed.append(s.rank)
        return left

    def _take(self, count: int, deadline: float) -> list[int]:
        with self._slots:
            while len(self._free) < count:
                if not self._slots.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError("no fence word free")
            taken, self._free = self._free[:count], self._free[count:]
            return taken

    def _give(self, slots: list[int]) -> None:
        with self._slots:
            self._free += slots
            self._slots.notify_all()


def check_hold_fences(
    fences: HoldFenceReader,
    links: ProducerLinks,
    handle: PullHandle,
    shares: Sequence[PullShare],
    timeout_s: float,
) -> bool:
    """The fences of a sample's shares, once their READs completed.

    ``FetchError`` says how a hold ended (its rank's answer to a release) if one did. True
    if every share READ had a fence; its release then needs no answer."""
    read = [s for s in shares if s.block_ids]
    fenced = [s for s in read if s.fence is not None]
    if not fenced:
        return not read
    try:
        fences.check(
            [(links.agent(handle.endpoints[s.rank]), s) for s in fenced], time.monotonic() + timeout_s
        )
    except TimeoutError as e:
        raise FetchError("timeout", f"sample {handle.request_id}: {e}") from None
    except HoldFenceStale as e:
        rank = e.ranks[0]
        reply = links.ask(
            handle,
            rank,
            handle.endpoints[rank],
            PullRelease(request_id=handle.request_id, nonce=handle.nonce),
        )
        said = f" ({reply.message})" if isinstance(reply, PullError) else ""
        code = reply.code if isinstance(reply, PullError) else "failed"
        raise FetchError(code, f"sample {handle.request_id}: rank {rank}: {e}{said}") from None
    return len(fenced) == len(read)


__all__ = ["FENCE_WORDS", "HoldFenceReader", "HoldFenceStale", "check_hold_fences"]
