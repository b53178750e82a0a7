"""The ceiling of ``a_over_a0``: the least a connector pays that moves every prompt's hidden
states out of the engine's cache into a reader's memory in another process by NIXL.

``RawShipConnector`` (the bench's arm ``ar``) does nothing else: in the step that computed
a prompt's last token it hands the prompt's blocks of the cache-only layer to its thread,
which posts one WRITE of them (whole blocks, in block-table order, as they lie) into the
next free stretch of the target's pool, with a notification saying what landed where. No
protocol, credits, integrity record, slot check or values screen; the blocks are not held
past the request (on this machine's shared-memory path the WRITE is one copy inside the
post), nothing acknowledges a sample. The target (``raw_target``, in the bench's process)
registers that pool and counts the notifications: a round ends when every prompt's has
arrived, as a's ends when its reader took every sample.

Held until acknowledged (the data path's arm ``ea``, the ceiling of d inside vLLM's
engine): where ``kv_connector_extra_config`` names ``"acks"``, the receiving end of the
target's acknowledgements registered under that name in ``ACKS`` (the harness runs the
engine in the bench's own process), a finished prompt's blocks stay held (``request_finished``)
until the target has acknowledged its WRITE's notification (``get_finished``, every step):
the least any connector pays that keeps a sample's blocks until its reader has it.

Bench code: the engine loads it with ``kv_connector_module_path``
``scripts.bench.raw_connector``; ``kv_connector_extra_config`` names the file the target
wrote its NIXL metadata to (``raw_target``).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kv_connector.wire.nixl_transport import NixlTransport
from kv_connector.wire.transport import Region, Transfer

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


# the receiving ends of targets' acknowledgements, by the name a config gives as "acks"
ACKS: dict[str, Connection] = {}


@dataclass
class RawShips(KVConnectorMetadata):
    """The step's prompts whose last token it computes: (request id, its tokens, its block ids)."""

    ships: list[tuple[str, int, list[int]]] = field(default_factory=list)


class RawShipConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self._target_file = Path(ktc.kv_connector_extra_config["raw_target"])
        acks = ktc.kv_connector_extra_config.get("acks")
        self._acks = None if acks is None else ACKS[acks]  # None: nothing held
        self.acked = 0  # prompts the target acknowledged so far (worker side)
        # scheduler side: each followed prompt's length and blocks so far
        self._prompts: dict[str, tuple[int, list[int]]] = {}
        # worker side
        self._t: NixlTransport | None = None
        self._local: Region | None = None
        self._remote: Region | None = None
        self._peer = ""
        self._pitch = self._block_bytes = 0
        self._at = 0  # where the next WRITE lands in the target's pool
        self._queue: queue.SimpleQueue[tuple[bytes, list[tuple[int, int, int]]]] = queue.SimpleQueue()
        self._block: dict[str, Any] = {}  # one block's shape as vLLM indexes it, its dtype
        self._block_size = 0

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        out = RawShips()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if len(new.block_ids) != 1:
                raise ValueError("the raw arm reads one KV cache group's block table")
            self._prompts[new.req_id] = (len(new.prompt_token_ids or ()), list(new.block_ids[0]))
            self._complete(new.req_id, new.num_computed_tokens + sched.get(new.req_id, 0), out)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._prompts:
                continue
            more = cached.new_block_ids[i]
            if more is not None:
                self._prompts[rid][1].extend(more[0])
            self._complete(rid, cached.num_computed_tokens[i] + sched.get(rid, 0), out)
        for rid in scheduler_output.finished_req_ids:
            self._prompts.pop(rid, None)
        return out

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._acks is not None, None  # held: until the target acknowledged it

    def _complete(self, rid: str, computed: int, out: RawShips) -> None:
        length, blocks = self._prompts[rid]
        if computed >= length:
            out.ships.append((rid, length, blocks))
            del self._prompts[rid]

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) != 1:
            raise ValueError(f"the raw arm needs one cache-only layer, found {len(layers)}")
        cache = kv_caches[next(iter(layers))]
        self._block_bytes = cache[0].numel() * cache.element_size()
        self._block_size = cache.shape[2]  # [num_blocks, layers, block_size, hidden]
        self._block = {"block_shape": list(cache.shape[1:]), "dtype": str(cache.dtype).removeprefix("torch.")}
        self._pitch = cache.stride(0) * cache.element_size()
        self._t = NixlTransport(f"raw-ship-{os.getpid()}")
        self._local = self._t.register(cache)
        target = json.loads(self._target_file.read_text())
        self._peer = self._t.add_peer(bytes.fromhex(target["metadata"]))
        self._remote = Region(target["addr"], target["nbytes"], "DRAM", 0)
        mine = self._target_file.with_suffix(".producer")
        mine.with_suffix(".tmp").write_text(self._t.metadata.hex())
        mine.with_suffix(".tmp").rename(mine)
        threading.Thread(target=self._ship, name="raw-ship", daemon=True).start()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RawShips) and self._remote is not None
        bb = self._block_bytes
        for rid, tokens, table in meta.ships:
            blocks = table[: -(-tokens // self._block_size)]
            if self._at + len(blocks) * bb > self._remote.nbytes:
                self._at = 0
            spans = [(b * self._pitch, self._at + k * bb, bb) for k, b in enumerate(blocks)]
            # the notification says what landed where (``raw_target.Landed``)
            note = json.dumps({"request_id": rid, "at": self._at, "tokens": tokens, **self._block})
            self._queue.put((note.encode(), spans))
            self._at += len(blocks) * bb

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The prompts the target acknowledged since the last step (their blocks come free)."""
        done: set[str] = set()
        while self._acks is not None and self._acks.poll(0):
            done.add(json.loads(self._acks.recv_bytes())["request_id"])
        self.acked += len(done)
        return done or None, None

    def _ship(self) -> None:
        """Posts each WRITE the steps queued and polls them to completion, on this one
        thread (a NIXL agent without a progress thread is not safe across threads; UCX
        moves a transfer, and sends its notification, only while it is polled)."""
        assert self._t is not None and self._local is not None and self._remote is not None
        live: list[Transfer] = []
        while True:
            try:
                note, spans = self._queue.get(timeout=None if not live else 0.0002)
                live.append(self._t.write(self._peer, self._local, self._remote, spans, note))
            except queue.Empty:
                pass
            live = [x for x in live if not self._t.poll(x)]
