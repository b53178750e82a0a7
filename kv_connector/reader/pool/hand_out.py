"""How every client makes a ``Sample`` of a checked run of its pool: the values verdict and the hand-out.

The hand-out is a view on lease or a copy. One module, so the push reader and the pull
client cannot drift apart in what they refuse or how they lend."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kv_connector.reader.pool.lease import CopyBuffers, Key, Lease, Sample
from kv_connector.reader.pool.memory import PoolMemory
from kv_connector.reader.pool.values import RowsScreen, screened_clean
from kv_connector.wire.identity import decode_metadata
from kv_connector.wire.protocol import Manifest


@dataclass(frozen=True)
class ValuesVerdict:
    """What is wrong with a sample's states (None: nothing), and how long looking at them took.

    The time is that of looking where they lie; None when the screen its checks read sufficed."""


    problem: str | None
    looked_s: float | None


def values_verdict(
    memory: PoolMemory, base: int, manifest: Manifest, screens: Sequence[RowsScreen | None], full: bool
) -> ValuesVerdict:
    """The states of the sample at ``base``: NaN/Inf, all-zero tokens or layers.

    Where every share was screened as its check read it (``screens``) and that screen saw
    nothing, nothing more is read. Otherwise the sample is looked at where it lies, every
    value with ``full``."""
    screened = [s for s in screens if s is not None]
    whole = bool(screens) and len(screened) == len(screens)
    if not full and whole and screened_clean(screened, manifest.num_tokens, manifest.num_layers):
        return ValuesVerdict(None, None)
    t0 = time.perf_counter()
    problem = memory.bad_values(base, manifest, full)
    return ValuesVerdict(problem, time.perf_counter() - t0)


def hand_out(
    memory: PoolMemory,
    base: int,
    manifest: Manifest,
    key: Key,
    release: Callable[[Key], None],
    copies: CopyBuffers | None,
) -> Sample:
    """The sample at ``base`` of ``memory``: a view of the pool on lease, or with ``copies`` a copy.

    The lease's end calls ``release(key)`` once the work queued before it is done. A copy's
    pages go back at once."""
    lease = Lease(key, memory.ordered(release))
    metadata = decode_metadata(manifest.metadata)
    if copies is not None:
        return Sample.of(manifest, memory.copy_out(base, manifest, lease, copies), key[0], metadata)
    return Sample.of(manifest, memory.leased(base, manifest, lease), key[0], metadata, lease)


__all__ = ["ValuesVerdict", "hand_out", "values_verdict"]
