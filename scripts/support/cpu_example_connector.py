"""vLLM's ExampleHiddenStatesConnector made CPU-safe, as a module vLLM can load by
``kv_connector_module_path`` (``"kv_connector": "CpuExampleHiddenStatesConnector",
"kv_connector_module_path": "scripts.support.cpu_example_connector"``).

The stock connector needs CUDA in two steps: its device-to-host copy (pinned memory on a
CUDA stream) becomes a plain gather on CPU, and the CUDA event ``get_finished`` polls
becomes the write's future. Everything else (one safetensors file per request under
``shared_storage_path``, its ``.lock`` held until written, ``hidden_states_path`` in the
request's ``kv_transfer_params``) is vLLM's own.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for a CUDA event: done when its future is."""

    def __init__(self, fut: Future[Any]) -> None:
        self.fut = fut

    def query(self) -> bool:
        return self.fut.done()

    def synchronize(self) -> None:
        return None


class CpuExampleHiddenStatesConnector(ExampleHiddenStatesConnector):  # type: ignore[misc]
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offs = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + offs[None, :]).flatten()
        assert self._kv_cache is not None
        hs = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {"hidden_states": hs, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        no_wait: Any = _Done(Future())  # nothing to wait for: the gather above is done
        fut = self._executor.submit(self._write_tensors, tensors, no_wait, pending.filename, lock_fd)
        done: Any = _Done(fut)  # stands in for the CUDA event get_finished() polls
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = fut
