"""What a user holds: a ``Sample`` whose tensors are views of the reader's pool, on lease.

Nothing is copied to hand a sample out. A sample's pages stay the sample's while the user
may read them. They return to the pool, as credits for producers, when the lease ends:
``sample.release()``, the end of a ``with`` block, or the garbage collection of the last
tensor viewing the pages, for a user who never thinks about it.

The reader's pool holds a sample as ``layout.BlockLayout.arranged_spans`` says, so
``hidden_states`` is one [T, L, H] view. It is a plain (contiguous) tensor where the
producer's cache blocks are token-major (vLLM's GPU layout, "TLH"). It is a strided one,
[L, T, H] in memory, where they are layer-major (vLLM's CPU layout, "LTH").

``CopyBuffers`` serve the copying mode, where a sample is copied out of the pool and its
pages go back at once. Its buffer is reused once its tensor is collected. Each buffer is
faulted in once when it is made, never fresh zeroed memory per sample.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from kv_connector.common.errors import ClosedError
from kv_connector.common.memory import host_memory
from kv_connector.wire.protocol import Manifest
from kv_connector.wire.provenance import Provenance

Key = tuple[str, str]
# copy buffers come in powers of two from this size
MIN_BUFFER = 64 << 10
# copy buffers kept for reuse: a client's pool size, or this
COPY_BUFFERS_MIN_BYTES = 64 << 20


class Lease:
    """A sample's hold on its pool pages; it ends once (``release``)."""

    __slots__ = ("__weakref__", "_done", "_lock", "_release", "key")

    def __init__(self, key: Key, release: Callable[[Key], None]) -> None:
        self.key = key
        self._release = release
        self._done = False
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return not self._done

    def release(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._release(self.key)


class Described(Protocol):
    """What names a received sample and its tokens.

    The pull client and the reader have a ``wire.protocol.Manifest``; the agent client has
    an ``agent.wire.AgentSample``."""

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def layer_ids(self) -> Sequence[int]: ...

    @property
    def sample_id(self) -> str | None: ...

    @property
    def provenance(self) -> Provenance | None: ...


class SampleReleased(ClosedError):
    """A released sample's tensors were asked for."""


class Sample:
    """One request's captured hidden states.

    request_id: the producer's request id.
    token_ids: [num_tokens] int64.
    hidden_states: [num_tokens, num_captured_layers, hidden_size], the producer's dtype; a
        view of the reader's pool while on lease (contiguous for the GPU block layout,
        strided for the CPU one), or a copy in copying mode.
    layer_ids: the captured layer ids, in the order of ``hidden_states``' second dim.
    producer_id: which producer sent it.
    sample_id: the user's name for it (the request's ``kv_transfer_params["sample_id"]``),
        the request id when none was given.
    metadata: the request's ``kv_transfer_params["metadata"]`` object ({} when none).
    provenance: what produced it (``wire.provenance.Provenance``: vLLM version, model
        runner, model), or None where its producer did not say.

    ``release()``, or leaving a ``with`` block, ends the lease: the pages return to the
    pool. The tensors must not be read afterwards; ``hidden_states`` then raises
    ``SampleReleased``. Without ``release()`` the lease ends when the last tensor viewing
    the pages is collected. A sample from the iterator is also released when the next one
    is asked for, unless you called ``keep()`` or hold its tensor or a view of it.
    """

    __slots__ = (
        "_hidden",
        "_kept",
        "_lease",
        "_views",
        "layer_ids",
        "metadata",
        "producer_id",
        "provenance",
        "request_id",
        "sample_id",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        token_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        layer_ids: tuple[int, ...],
        producer_id: str = "",
        lease: Lease | None = None,
        sample_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        provenance: Provenance | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self._hidden = hidden_states
        self.layer_ids = layer_ids
        self.producer_id = producer_id
        self.sample_id = sample_id or request_id
        self.metadata = metadata if metadata is not None else {}
        self.provenance = provenance
        self._lease = lease
        self._kept = False
        # how many tensors share the pool's memory now: more later means the user made views
        self._views = _views_of(hidden_states) if lease is not None else 0

    @classmethod
    def of(
        cls,
        what: Described,
        hidden_states: torch.Tensor,
        producer_id: str,
        metadata: dict[str, Any],
        lease: Lease | None = None,
    ) -> Sample:
        """The sample ``what`` describes, as every client hands one out.

        ``what`` gives its request and sample ids, its tokens and its layers. It holds
        ``hidden_states`` on ``lease`` (None: a copy)."""
        return cls(
            request_id=what.request_id,
            # by numpy: a third of torch.tensor's time on a list of ints, all of it under the GIL
            token_ids=torch.from_numpy(np.array(what.token_ids, dtype=np.int64)),
            hidden_states=hidden_states,
            layer_ids=tuple(what.layer_ids),
            producer_id=producer_id,
            lease=lease,
            sample_id=what.sample_id,
            metadata=metadata,
            provenance=what.provenance,
        )

    @property
    def hidden_states(self) -> torch.Tensor:
        """[num_tokens, num_layers, hidden_size].

        ``SampleReleased`` once the lease ended, since its pages may hold another sample by now."""
        if self._lease is not None and not self._lease.held:
            raise SampleReleased(
                f"sample {self.request_id} was released (by release(), a with block, or the "
                "iterator when you asked for the next sample): its pages hold other data now. "
                "Call sample.keep() before asking for the next one, keep its tensor, or read "
                "with copy=True"
            )
        return self._hidden

    def keep(self) -> Sample:
        """Keep this sample on lease when the iterator moves on. Returns the sample.

        The lease lasts until ``release`` or until the sample is collected."""
        self._kept = True
        return self

    @property
    def leased(self) -> bool:
        """Its tensors are views of the reader's pool, and the lease has not ended."""
        return self._lease is not None and self._lease.held

    def release(self) -> None:
        """End the lease now: its pages go back to the producers.

        Do not read its tensors afterwards; copy what you keep. A copy, or a sample released
        already: nothing."""
        if self._lease is not None:
            self._lease.release()

    def let_go(self) -> bool:
        """The iterator moves on: end the lease unless the user kept the sample. True if it ended.

        The user keeps it by ``keep``, by its tensor, or by a view of its memory. A released
        sample's ``hidden_states`` raises, so nothing reads reused pages through it."""
        if not self.leased or self._kept:
            return False
        # the tensor is referenced by this sample's slot and getrefcount's argument
        if sys.getrefcount(self._hidden) > 2 or _views_of(self._hidden) > self._views:
            return False
        self.release()
        return True

    def __enter__(self) -> Sample:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        shape = tuple(self._hidden.shape)
        state = "leased" if self.leased else "released" if self._lease is not None else "copy"
        name = self.request_id
        if self.sample_id != self.request_id:
            name = f"{self.sample_id} ({self.request_id})"
        return f"Sample({name!r}, producer {self.producer_id!r}, hidden_states {shape}, {state})"


def _views_of(tensor: torch.Tensor) -> int:
    """Tensors sharing ``tensor``'s memory (torch's use count of its storage)."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


def sample_view(raw: torch.Tensor, manifest: Manifest) -> torch.Tensor:
    """[T, L, H] of the sample's dtype over ``raw``, the uint8 bytes of its run."""
    g, nb = manifest.geometry, manifest.num_blocks
    rows = nb * g.block_size
    typed = raw[: g.sample_bytes(nb)].view(getattr(torch, g.dtype))
    if g.layout == "TLH":
        return typed.view(rows, g.num_layers, g.hidden_size)[: manifest.num_tokens]
    return typed.view(g.num_layers, rows, g.hidden_size)[:, : manifest.num_tokens].permute(1, 0, 2)


def leased_view(pool: np.ndarray, base: int, manifest: Manifest, lease: Lease) -> torch.Tensor:
    """The sample's [T, L, H] view of the pool.

    The lease ends when no tensor sharing this view's memory is left."""
    # a new array object
    arr = pool[base : base + manifest.geometry.sample_bytes(manifest.num_blocks)]
    # its storage keeps ``arr`` alive, and every view the storage
    raw = torch.from_numpy(arr)
    weakref.finalize(arr, lease.release)
    return sample_view(raw, manifest)


class CopyBuffers:
    """Reused output buffers for the copying mode, at most ``max_bytes`` kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._kept = 0
        self._lock = threading.Lock()
        # buffers made (a measure of reuse)
        self.allocated = 0

    @classmethod
    def for_pool(cls, pool_bytes: int) -> CopyBuffers:
        """Buffers for a client whose pool has ``pool_bytes``; as many are kept as the pool holds.

        A fresh allocation per sample would cost more in page faults than the copy."""
        return cls(max(pool_bytes, COPY_BUFFERS_MIN_BYTES))

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of uint8 in a reused buffer.

        The buffer goes back to the pool when its last view is collected."""

        size = max(MIN_BUFFER, 1 << (max(nbytes, 1) - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is None:
                self.allocated += 1
            else:
                self._kept -= size
        if buf is None:
            # huge pages, faulted in once
            buf = host_memory(size)
        arr = buf[:nbytes]
        weakref.finalize(arr, self._give_back, buf)
        return torch.from_numpy(arr)

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._kept + buf.nbytes <= self.max_bytes:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._kept += buf.nbytes
