"""A node-local store of the rows a trainer fetched: capture once, train many.

Each row is written once, in speculators' own file layout (``hs_<file_idx>.safetensors``:
``token_ids`` and ``hidden_states``, or its fp8 layout), by a thread of its own after the
row was handed to the trainer, so keeping never delays a row. A file is written under a
temporary name and renamed (a reader never sees a torn one) and carries an integrity
record (XXH3-64 of its tensors' bytes) that every read here verifies: a damaged file is
set aside, counted, and its row fetched again; a record per part (tokens, each layer)
lets a read of some layers, found by their ids, verify them without the others' bytes.
speculators' file backends read the same folder without this package.

At the budget keeping stops (a warning, once): nothing kept is evicted, since the
sampler will ask for it again. Two runs may share a folder when they keep the same rows:
the folder names what it keeps (``keep.json``: the layout, and the model and layer ids
where the run knows them), written once by the first run, and a run that would keep
other rows (another model, other layers, another layout) is refused at its start
(``claim_folder``); rows alike are safe to keep at once, since each file appears whole by
its rename and every read verifies it. Each run counts the folder as it found it plus its
own files against its budget (so together they may pass it by the rows they keep at once).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import socket
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open

from kv_connector.common.errors import ConfigurationError
from kv_connector.files.fp8 import SCALES_KEY, Fp8Scale, dequantize, quantize
from kv_connector.files.safetensors_io import write_atomically

log = logging.getLogger(__name__)

# the file's integrity record, in its metadata
RECORD_KEY = "kv_keep_xxh3"
# the same per part (tokens, each layer, scales): reads of some layers
PARTS_KEY = "kv_keep_xxh3_parts"
# the captured layer ids of the row's states, in order
LAYERS_KEY = "layer_ids"
# each process's temporary files, in a folder of its own
TMP_ROOT = ".keep-tmp"
DAMAGED_SUFFIX = ".damaged"
# what the folder's rows are, written once by the first run
MANIFEST = "keep.json"
# rows waiting for the writer; beyond, a row is not kept (never waited for)
MAX_QUEUED = 64


def file_of(root: Path, file_idx: int) -> Path:
    """Where speculators' file backend looks for row ``file_idx``."""
    return root / f"hs_{file_idx}.safetensors"


def record_of(tensors: dict[str, torch.Tensor]) -> str:
    """XXH3-64 over each tensor's name and bytes, in name order (hex)."""
    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


class KeepFolderMismatch(ConfigurationError):
    """The keep folder holds other rows than this run would keep (another model, other
    layers, another layout): sharing it would hand one run the other's states."""


def claim_folder(root: Path | str, describes: dict[str, str]) -> dict[str, str]:
    """Bind ``root`` (made if missing) to what its rows are: the first run writes
    ``describes`` as the folder's ``keep.json`` (created whole, only if absent); a later
    run whose ``describes`` differs in a key both name is refused (``KeepFolderMismatch``),
    except a run whose layer ids are some of the folder's (it reads its layers by id).
    Returns what the folder says it keeps."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / MANIFEST
    tmp = root / f".{MANIFEST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(describes, sort_keys=True))
    try:
        # atomic: the first run's, whole, or nothing
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    theirs: dict[str, str] = json.loads(path.read_text())
    differs = [
        f"{k}: the folder keeps {theirs[k]!r}, this run {v!r}"
        for k, v in sorted(describes.items())
        if k in theirs and theirs[k] != v and not (k == LAYERS_KEY and _some_of(v, theirs[k]))
    ]
    if differs:
        raise KeepFolderMismatch(
            f"the keep folder {root} holds other rows than this run keeps ({'; '.join(differs)}): "
            "give this run a folder of its own"
        )
    return theirs


def xxh3_of(tensor: torch.Tensor) -> str:
    """XXH3-64 of one tensor's bytes (hex)."""
    return xxhash.xxh3_64_hexdigest(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def parts_record(tensors: dict[str, torch.Tensor]) -> str:
    """Each part's own record (JSON): the token ids, each layer of the states by position,
    the fp8 scales; what a read of some layers verifies without the others' bytes."""
    states = tensors["hidden_states"]
    parts: dict[str, object] = {
        "token_ids": xxh3_of(tensors["token_ids"]),
        "layers": [xxh3_of(states[:, p]) for p in range(states.shape[1])],
    }
    if SCALES_KEY in tensors:
        parts["scales"] = xxh3_of(tensors[SCALES_KEY])
    return json.dumps(parts)


def layer_ids_of(meta: dict[str, str]) -> list[int] | None:
    """The row's captured layer ids, as its metadata names them (None: not named)."""
    said = meta.get(LAYERS_KEY)
    return [int(i) for i in said.split(",") if i.strip()] if said else None


@dataclass
class KeepStats:
    """What the store did in this process: rows found and verified (``hits``), not found
    (``misses``), kept, set aside as damaged, and not kept at the budget, with the queue
    full, or on a write error."""

    hits: int = 0
    misses: int = 0
    kept: int = 0
    kept_bytes: int = 0
    damaged: int = 0
    over_budget: int = 0
    busy: int = 0
    write_errors: int = 0


class RowStore:
    """Rows kept in ``root`` (made if missing), at most ``budget_bytes`` of files there
    (None: no limit); ``fp8`` keeps them in speculators' fp8 layout (scales per token or
    layer) and hands them back dequantized to ``dtype``."""

    def __init__(
        self,
        root: Path | str,
        budget_bytes: int | None = None,
        fp8: Fp8Scale | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ConfigurationError(f"the keep budget must be positive, got {budget_bytes} bytes")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.fp8 = fp8
        self.dtype = dtype
        self.stats = KeepStats()
        # this process's folder for partial files (another's is cleared once it is gone)
        self.tmp = self.root / TMP_ROOT / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._clear_dead_tmp()
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._used = sum(p.stat().st_size for p in self.root.glob("hs_*.safetensors"))
        self._full = False
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, torch.Tensor, torch.Tensor, dict[str, str]] | None] = queue.Queue(
            MAX_QUEUED
        )
        self._writer: threading.Thread | None = None

    def get(self, file_idx: int, layer_ids: list[int] | None = None) -> dict[str, torch.Tensor] | None:
        """Row ``file_idx`` as speculators' backends return it (``token_ids`` int64 [T],
        ``hidden_states`` [T, L, H]), verified; None if it is not kept or was damaged.
        ``layer_ids``: only these captured layers, in this order, found by their ids in the
        row's metadata (never by position) and read and verified alone, where the row holds
        more; None (a miss) where it lacks one."""
        path = file_of(self.root, file_idx)
        try:
            with safe_open(str(path), framework="pt") as f:  # type: ignore[no-untyped-call]
                meta = f.metadata() or {}
                stored = layer_ids_of(meta)
                if layer_ids is not None and stored is not None and list(layer_ids) != stored:
                    return self._some_layers(f, meta, path, stored, list(layer_ids))
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        except FileNotFoundError:
            self._count("misses")
            return None
        # a torn header or a truncated file: damaged
        except Exception as e:
            self._set_aside(path, f"unreadable ({type(e).__name__}: {e})")
            return None
        want = meta.get(RECORD_KEY)
        if want is None or record_of(tensors) != want:
            self._set_aside(path, "its integrity record does not match its bytes" if want else "no record")
            return None
        if layer_ids is not None and stored is None:
            # a row that does not name its layers cannot be read by id
            self._count("misses")
            return None
        self._count("hits")
        states = tensors["hidden_states"]
        if SCALES_KEY in tensors:
            states = dequantize(states, tensors[SCALES_KEY], self.dtype)
        return {"token_ids": tensors["token_ids"], "hidden_states": states}

    def _some_layers(
        self, row_file: Any, meta: dict[str, str], path: Path, stored: list[int], wanted: list[int]
    ) -> dict[str, torch.Tensor] | None:
        """The ``wanted`` layers of an open row file, each sliced out of the file by its
        position among the row's ``stored`` ids and checked against its own record."""
        if any(i not in stored for i in wanted) or PARTS_KEY not in meta:
            # the row lacks a wanted layer (or per-layer records)
            self._count("misses")
            return None
        parts = json.loads(meta[PARTS_KEY])
        positions = [stored.index(i) for i in wanted]
        tokens = row_file.get_tensor("token_ids")
        sliced = row_file.get_slice("hidden_states")
        layers = [sliced[:, p : p + 1] for p in positions]
        scales = row_file.get_tensor(SCALES_KEY) if SCALES_KEY in row_file.keys() else None  # noqa: SIM118
        bad = xxh3_of(tokens) != parts["token_ids"] or any(
            xxh3_of(t[:, 0]) != parts["layers"][p] for t, p in zip(layers, positions, strict=True)
        )
        if scales is not None and xxh3_of(scales) != parts.get("scales"):
            bad = True
        if bad:
            self._set_aside(path, "a layer's or its tokens' record does not match its bytes")
            return None
        self._count("hits")
        states = torch.cat(layers, dim=1)
        if scales is not None:
            per_layer = scales.shape[1] > 1
            states = dequantize(states, scales[:, positions] if per_layer else scales, self.dtype)
        return {"token_ids": tokens, "hidden_states": states}

    @property
    def queued(self) -> int:
        """Rows put and not yet written (at most ``MAX_QUEUED``)."""
        return self._queue.qsize()

    def put(
        self, file_idx: int, token_ids: torch.Tensor, hidden_states: torch.Tensor, meta: dict[str, str]
    ) -> bool:
        """Keep a row (queued for the writer thread; the tensors must not change after);
        False if it will not be kept (the budget, or the writer is behind)."""
        if self._full:
            self._count("over_budget")
            return False
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_rows, name="kv-keep-writer", daemon=True)
            self._writer.start()
        try:
            self._queue.put_nowait((file_idx, token_ids, hidden_states, meta))
        except queue.Full:
            self._count("busy")
            return False
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued (for up to ``timeout_s``), then stop the writer."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout_s)
            self._writer = None
        with contextlib.suppress(OSError):
            shutil.rmtree(self.tmp)

    def _write_rows(self) -> None:
        while (job := self._queue.get()) is not None:
            file_idx, token_ids, states, meta = job
            try:
                self._write(file_idx, token_ids, states, meta)
            except Exception as e:
                self._count("write_errors")
                log.warning("row %d was not kept in %s: %s", file_idx, self.root, e)

    def _write(
        self, file_idx: int, token_ids: torch.Tensor, states: torch.Tensor, meta: dict[str, str]
    ) -> None:
        tensors = {"hidden_states": states, "token_ids": token_ids}
        meta = dict(meta)
        if self.fp8 is not None:
            q, scales = quantize(states, self.fp8)
            tensors = {"hidden_states": q, SCALES_KEY: scales, "token_ids": token_ids}
            meta["fp8_scale"], meta["dtype"] = self.fp8.value, str(states.dtype).removeprefix("torch.")
        meta[RECORD_KEY] = record_of(tensors)
        meta[PARTS_KEY] = parts_record(tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._lock:
            if self.budget_bytes is not None and self._used + size > self.budget_bytes:
                if not self._full:
                    log.warning(
                        "the keep folder %s reached its budget (%.2f GiB): later rows are fetched every "
                        "epoch; the rows kept so far stay",
                        self.root,
                        self.budget_bytes / 2**30,
                    )
                self._full = True
                self.stats.over_budget += 1
                return
            self._used += size
        try:
            write_atomically(file_of(self.root, file_idx), tensors, meta, self.tmp)
        except OSError as e:
            with self._lock:
                self._used -= size
            # ENOSPC, EDQUOT: the disk is full, keeping stops
            if e.errno in (28, 122):
                self._full = True
                log.warning("the keep folder %s is full (%s): keeping stops, training goes on", self.root, e)
            raise
        with self._lock:
            self.stats.kept += 1
            self.stats.kept_bytes += size

    def _set_aside(self, path: Path, why: str) -> None:
        self._count("damaged")
        log.warning("kept row %s is damaged (%s): fetched again", path.name, why)
        with contextlib.suppress(OSError):
            os.replace(path, path.with_name(path.name + DAMAGED_SUFFIX))

    def _count(self, key: str) -> None:
        with self._lock:
            setattr(self.stats, key, getattr(self.stats, key) + 1)

    def _clear_dead_tmp(self) -> None:
        """Remove the temporary folders of this host's processes that are gone (a rank
        killed while writing leaves its partial file there, never under a row's name)."""
        host = socket.gethostname()
        base = self.root / TMP_ROOT
        if not base.is_dir():
            return
        for d in base.iterdir():
            name, _, pid = d.name.rpartition("-")[0].rpartition("-")
            if name != host or not pid.isdigit() or _alive(int(pid)):
                continue
            shutil.rmtree(d, ignore_errors=True)


def _some_of(ids: str, of: str) -> bool:
    """Whether the layer ids ``ids`` ("1,4") are all among ``of`` ("1,2,4")."""
    return set(ids.split(",")) <= set(of.split(","))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
