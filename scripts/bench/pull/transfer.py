"""The DataLoader workers' side of ``scripts.bench.pull``: a speculators
``HiddenStatesTransfer`` that times its wrapped transfer's ``get_generated`` and
``delete`` (one line per call appended to a file: each worker is a process of its own),
and ``ManifestOnly``, the pull backend with nothing read (the ceiling arm). Imports
speculators' ``hs_connectors``: only for a process whose PYTHONPATH holds it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from hs_connectors.transfer import HiddenStatesTransfer


class TimedTransfer(HiddenStatesTransfer):
    def __init__(self, inner: HiddenStatesTransfer, log_path: Path) -> None:
        self.inner = inner
        self.log_path = log_path

    def _log(self, what: str, seconds: float) -> None:
        with open(self.log_path, "a") as f:
            f.write(f"{what} {seconds:.6f} {os.getpid()}\n")

    def setup(self) -> None:
        self.inner.setup()

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        out: dict[str, torch.Tensor] | None = self.inner.get_cached(file_idx)
        return out

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        t0 = time.perf_counter()
        out: dict[str, torch.Tensor] | None = self.inner.get_generated(hs_transfer_params)
        self._log("get_generated", time.perf_counter() - t0)
        return out

    def delete(self, handle: str) -> None:
        t0 = time.perf_counter()
        self.inner.delete(handle)
        self._log("delete", time.perf_counter() - t0)


class ManifestOnly(HiddenStatesTransfer):
    """The pull backend less its data: ``get_generated`` asks the producer for the row's
    manifest (its token ids), releases the sample and returns one constant tensor of the
    row's shape, nothing READ, copied or checked. What speculators' DataLoader does per
    row around a transfer that costs nothing: the ceiling of ``pull_over_file``."""

    def __init__(self) -> None:
        from kv_connector.reader import PullClient
        from kv_connector.reader.pull.links import PAGE_BYTES

        self.client = PullClient(pool_bytes=PAGE_BYTES)  # asks for manifests only: nothing lands
        self._states: torch.Tensor | None = None

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        return None

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        m = self.client.manifest(hs_transfer_params)
        self.client.release(hs_transfer_params)
        shape = (m.num_tokens, m.num_layers, m.hidden_size)
        states = self._states
        if states is None or states.shape[0] < m.num_tokens or states.shape[1:] != shape[1:]:
            states = self._states = torch.ones(shape, dtype=getattr(torch, m.dtype))
        token_ids = torch.tensor(m.token_ids, dtype=torch.int64)
        return {"token_ids": token_ids, "hidden_states": states[: shape[0]]}

    def delete(self, handle: str) -> None:
        return None  # released in get_generated


def read_log(log_path: Path) -> dict[str, float]:
    """Seconds per call kind since the last read (the file is emptied)."""
    out: dict[str, float] = {}
    if not log_path.exists():
        return out
    text = log_path.read_text()
    log_path.write_text("")
    for line in text.splitlines():
        what, secs, _pid = line.split()
        out[what] = out.get(what, 0.0) + float(secs)
    return out
