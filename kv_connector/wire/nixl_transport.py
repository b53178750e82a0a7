"""The NIXL transport: the one module that imports nixl.

A ``NixlTransport`` is one NIXL agent on the UCX backend, without NIXL's progress thread
(it spins a whole core per agent; on small machines that starves vLLM). Progress is made
by the caller polling ``poll`` and ``notifications`` on both sides. It implements
``kv_connector.wire.transport.Transport``.

Before its UCX context exists, an agent gets the UCX settings GPU buffers need on one node
(``ucx_report.UCX_DEFAULTS``, through NIXL's ``engine_config``; never over a user's
``UCX_*``) and asks UCX to describe its WRITE and READ choices in files of a directory of
its own; at the first completion of each kind of transfer it reads them, logs the
transport of each pairing and warns where ``tcp`` carries a GPU buffer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kv_connector.wire import ucx_report
from kv_connector.wire.transport import MemType, Region, Transfer, TransportError

log = logging.getLogger(__name__)

_DONE, _PROC, _ERR = "DONE", "PROC", "ERR"


NIXL_VERSION = "1.5.1"


def nixl_wheel(torch_cuda: str | None) -> str:
    """The NIXL wheel for a torch built against CUDA ``torch_cuda`` (``torch.version.cuda``,
    None for a CPU build): the ``nixl`` meta package imports ``nixl_cu{that major}``.
    vLLM 0.33 pins a CUDA 13 torch (nixl-cu13); vLLM 0.32's CUDA build a CUDA 12 one, and
    the CPU build takes nixl-cu12 (it falls back to whichever backend is installed)."""
    major = torch_cuda.split(".")[0] if torch_cuda else "12"
    return f"nixl-cu{major}"


def install_hint(torch_cuda: str | None) -> str:
    """How to install NIXL for this torch, in one line."""
    built = f"torch {torch.__version__} built for CUDA {torch_cuda}" if torch_cuda else "a CPU build of torch"
    return (
        f"pip install {nixl_wheel(torch_cuda)}=={NIXL_VERSION} && pip install --no-deps nixl=={NIXL_VERSION} "
        f"(for {built}; the nixl package loads nixl_cu<torch's CUDA major>: nixl-cu13 for vLLM 0.33, "
        "nixl-cu12 for vLLM 0.32)"
    )


def _nixl() -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise TransportError(f"NIXL cannot be imported ({e}): {install_hint(torch.version.cuda)}") from e
    _quiet_nixl_logger()
    return nixl_agent, nixl_agent_config


def require_nixl() -> None:
    """``TransportError`` naming the wheel to install unless NIXL imports here (for a
    user who must know when an object is made, before its agent is)."""
    _nixl()


def _quiet_nixl_logger() -> None:
    """NIXL's Python logger prints INFO lines to stdout; keep stdout for our programs'
    output: its lines go to stderr, and below WARNING only when NIXL_LOG_LEVEL asks."""
    nl = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nl.setLevel(logging.WARNING)
    for h in nl.handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)


def mem_type_of(tensor: torch.Tensor) -> tuple[MemType, int]:
    """("DRAM", 0) for host memory, ("VRAM", device index) for a GPU tensor."""
    if tensor.device.type == "cpu":
        return "DRAM", 0
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index or 0
    raise TransportError(f"cannot register memory on device {tensor.device}")


class _Transfer:
    """One posted WRITE or READ; poll it with ``NixlTransport.poll`` until it is done."""

    __slots__ = ("handle", "kind", "nbytes", "op", "peer")

    def __init__(
        self, handle: Any, peer: str, nbytes: int, op: str = "WRITE", kind: tuple[str, ...] = ()
    ) -> None:
        self.handle = handle
        self.peer = peer
        self.nbytes = nbytes
        self.op = op
        self.kind = kind  # (peer, op, local memory, remote memory): the first of each is reported


_CHOICES: dict[tuple[str, ucx_report.Pairing], tuple[str, ...]] = {}  # (agent, pairing) -> transports
_CHOICES_LOCK = threading.Lock()


def ucx_choices() -> dict[str, dict[str, list[str]]]:
    """What UCX chose in this process, as its agents read it: agent -> pairing -> the
    transports of its large transfers."""
    out: dict[str, dict[str, list[str]]] = {}
    with _CHOICES_LOCK:
        for (agent, pairing), ts in sorted(_CHOICES.items(), key=lambda x: (x[0][0], str(x[0][1]))):
            out.setdefault(agent, {})[str(pairing)] = list(ts)
    return out


_REPORT_PREFIX = "kvc-ucx-"  # then the pid: directories of processes gone are pruned


def _report_dir() -> tuple[str | None, bool]:
    """Where UCX describes this agent's choices, and whether the directory is ours to
    remove: the user's ``UCX_PROTO_INFO_DIR`` (``%p``, ``%h`` filled in as UCX does),
    else a new temporary one; None when ``KV_CONNECTOR_UCX_REPORT`` is off."""
    if ucx_report.switched_off(os.environ, ucx_report.REPORT_SWITCH):
        return None, False
    theirs = os.environ.get("UCX_PROTO_INFO_DIR")
    if theirs:
        return theirs.replace("%p", str(os.getpid())).replace("%h", socket.gethostname()), False
    _prune_reports()
    # short: UCX cuts a report file's whole path at 255 bytes
    return tempfile.mkdtemp(prefix=f"{_REPORT_PREFIX}{os.getpid()}-"), True


def _prune_reports() -> None:
    """Remove the report directories of processes that are gone (killed before their
    agents closed); a directory holds only the descriptions not read yet."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            pid = entry.name.removeprefix(_REPORT_PREFIX).split("-", 1)[0]
            if entry.name.startswith(_REPORT_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


class NixlTransport:
    """One NIXL agent (UCX backend, no progress thread)."""

    def __init__(
        self, name: str, ucx_params: dict[str, str] | None = None, lap: Callable[[str], object] | None = None
    ) -> None:
        """``lap``, when given, is called with each start phase's name as it ends (what a
        fetch agent's start log times)."""
        lap = lap or (lambda _name: None)
        nixl_agent, nixl_agent_config = _nixl()
        lap("NIXL import")
        params = dict(ucx_params or {})
        if "ucx_error_handling_mode" not in params and os.environ.get("KV_CONNECTOR_UCX_ERROR_HANDLING"):
            params["ucx_error_handling_mode"] = os.environ["KV_CONNECTOR_UCX_ERROR_HANDLING"]
        self._report, self._own_report = _report_dir()
        params["engine_config"], applied = ucx_report.engine_config(
            os.environ, params.get("engine_config", ""), self._report if self._own_report else None
        )
        try:
            self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
            lap("NIXL agent")
            self._agent.create_backend("UCX", params)
            lap("UCX")
        except Exception as e:
            self._drop_report()
            raise TransportError(f"cannot create the NIXL agent {name!r} on UCX: {e}") from e
        log.debug(
            "NIXL agent %s: UCX engine_config %r (our defaults: %s)",
            name,
            params["engine_config"],
            ", ".join(f"{s.key}={s.value}" for s in applied) or "none",
        )
        self._kinds: set[tuple[str, ...]] = set()
        self._read: set[str] = set()  # report files read
        self.name = name
        self.failed_polls = 0
        self._regs: dict[Region, Any] = {}
        self._peers: set[str] = set()

    @property
    def metadata(self) -> bytes:
        """This agent's metadata (connection info and memory keys) for ``add_peer``."""
        return bytes(self._agent.get_agent_metadata())

    def register(self, tensor: torch.Tensor) -> Region:
        """Register a tensor's memory once (no copy). The tensor must be dense (any
        permutation of a contiguous tensor), so its bytes are one range."""
        span = 1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
        if tensor.numel() == 0 or span != tensor.numel() or min(tensor.stride()) < 0:
            raise TransportError("only a dense tensor's memory can be registered")
        mem_type, dev = mem_type_of(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        try:
            reg = self._agent.register_memory([(tensor.data_ptr(), nbytes, dev, "")], mem_type)
        except Exception as e:
            raise TransportError(f"cannot register {nbytes} bytes of {mem_type}: {e}") from e
        region = Region(tensor.data_ptr(), nbytes, mem_type, dev)
        self._regs[region] = reg
        return region

    def deregister(self, region: Region) -> None:
        """Release a registration made by ``register`` (before the memory is freed or
        remapped); the agent's ``metadata`` no longer names it. No WRITE may be in flight
        from it. Nothing happens for a region not registered."""
        reg = self._regs.pop(region, None)
        if reg is None:
            return
        try:
            self._agent.deregister_memory(reg)
        except Exception as e:
            raise TransportError(f"cannot deregister {region.nbytes} bytes of {region.mem_type}: {e}") from e

    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent's metadata; returns its name."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise TransportError(f"cannot load a remote agent's metadata: {e}") from e
        peer = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as e:
                log.warning("removing NIXL peer %s failed: %s", peer, e)

    def write(
        self,
        peer: str,
        local: Region,
        remote: Region,
        spans: Sequence[tuple[int, int, int]] | np.ndarray,
        notif: bytes,
    ) -> Transfer:
        """Post one WRITE of ``spans`` = (local offset, remote offset, length) rows from
        ``local`` into the peer's ``remote`` region, with ``notif`` delivered after the
        data landed."""
        return self._post("WRITE", peer, local, remote, spans, notif)

    def read(
        self,
        peer: str,
        local: Region,
        remote: Region,
        spans: Sequence[tuple[int, int, int]] | np.ndarray,
    ) -> Transfer:
        """Post one READ of ``spans`` = (local offset, remote offset, length) rows from the
        peer's ``remote`` region into ``local`` (no notification: pull delivery releases
        over its control connection)."""
        return self._post("READ", peer, local, remote, spans, b"")

    def _post(
        self,
        op: str,
        peer: str,
        local: Region,
        remote: Region,
        spans: Sequence[tuple[int, int, int]] | np.ndarray,
        notif: bytes,
    ) -> Transfer:
        arr = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
        if arr.size == 0:
            raise TransportError(f"a {op} needs at least one span")
        n = len(arr)
        src = np.empty((n, 3), dtype=np.uint64)
        dst = np.empty((n, 3), dtype=np.uint64)
        src[:, 0] = local.addr + arr[:, 0]
        src[:, 1] = arr[:, 2]
        src[:, 2] = local.device_id
        dst[:, 0] = remote.addr + arr[:, 1]
        dst[:, 1] = arr[:, 2]
        dst[:, 2] = remote.device_id
        try:
            handle = self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(src, local.mem_type),
                self._agent.get_xfer_descs(dst, remote.mem_type),
                peer,
                notif,
            )
            state = self._agent.transfer(handle)
        except Exception as e:
            raise TransportError(f"cannot post a {op} to {peer}: {e}") from e
        if state == _ERR:
            self._agent.release_xfer_handle(handle)
            raise TransportError(f"NIXL refused a {op} to {peer}")
        return _Transfer(handle, peer, int(arr[:, 2].sum()), op, (peer, op, local.mem_type, remote.mem_type))

    def poll(self, xfer: Transfer) -> bool:
        """True once the WRITE (or READ) completed (its handle is then released); raises
        ``TransportError`` if it failed."""
        assert isinstance(xfer, _Transfer)
        try:
            state = self._agent.check_xfer_state(xfer.handle)
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer is gone
            with contextlib.suppress(Exception):
                self._agent.release_xfer_handle(xfer.handle)
            raise TransportError(f"a {xfer.op} of {xfer.nbytes} bytes with {xfer.peer} failed: {e}") from None
        if state == _PROC:
            return False
        with contextlib.suppress(Exception):
            self._agent.release_xfer_handle(xfer.handle)
        if state == _DONE:
            if xfer.kind not in self._kinds:  # UCX chose its transport when it was posted
                self._kinds.add(xfer.kind)
                try:
                    self.report_choices()
                except Exception as e:  # a report never fails a transfer
                    log.debug("NIXL agent %s: UCX's report unread: %s", self.name, e)
            return True
        raise TransportError(f"a {xfer.op} of {xfer.nbytes} bytes with {xfer.peer} failed")

    def notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as (peer name, message); also makes UCX progress."""
        out: list[tuple[str, bytes]] = []
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:  # a peer's disconnect surfaces here too
            # what that poll had gathered is lost with it; the samples it announced end at
            # their deadline (the reader refuses them, their producers fail them by name)
            self.failed_polls += 1
            log.error("NIXL notification poll failed (%d so far): %s", self.failed_polls, e)
            return out
        for peer, msgs in notifs.items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            out.extend((name, bytes(m)) for m in msgs)
        return out

    def report_choices(self) -> dict[ucx_report.Pairing, tuple[str, ...]]:
        """Read UCX's new descriptions of this agent's choices, log the transport of each
        pairing new to this agent, and warn where ``tcp`` carries a GPU buffer; returns the
        new pairings. Nothing when UCX describes nothing (``UCX_PROTO_INFO=n``)."""
        choices = []
        for file_name in self._report_files():
            path = os.path.join(self._report or "", file_name)
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                continue
            self._read.add(file_name)
            if self._own_report:  # read once: nothing is left behind the agent
                with contextlib.suppress(OSError):
                    os.unlink(path)
            c = ucx_report.choice_of(file_name, text, self.name)
            if c is not None and c.pairing.reach is not ucx_report.Reach.SELF:  # its loopback
                choices.append(c)
        new: dict[ucx_report.Pairing, tuple[str, ...]] = {}
        with _CHOICES_LOCK:
            for pairing, found in ucx_report.bulk(choices).items():
                key = (self.name, pairing)
                before = _CHOICES.get(key, ())
                ts = tuple(sorted(set(before) | set(found)))  # variants may come in later calls
                if ts != before:
                    _CHOICES[key] = new[pairing] = ts
        for pairing, ts in new.items():
            log.info("NIXL agent %s: UCX moves a %s over %s", self.name, pairing, ", ".join(ts))
            if (fix := ucx_report.advice(pairing, ts)) is not None:
                log.warning(
                    "NIXL agent %s: UCX moves a %s over %s, a GPU buffer over TCP: %s "
                    '(docs/usage.md, "Transports on one node")',
                    self.name,
                    pairing,
                    ", ".join(ts),
                    fix,
                )
        return new

    def _report_files(self) -> list[str]:
        if self._report is None:
            return []
        try:
            names = os.listdir(self._report)
        except OSError:  # UCX makes the directory at its first description
            return []
        prefix = ucx_report.sanitized(self.name) + "_"
        return sorted(n for n in names if n.startswith(prefix) and n.endswith(".dot") and n not in self._read)

    def _drop_report(self) -> None:
        if self._own_report and self._report is not None:
            shutil.rmtree(self._report, ignore_errors=True)
            self._own_report = False

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_peer(peer)
        for reg in self._regs.values():
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.warning("deregistering NIXL memory failed: %s", e)
        self._regs.clear()
        self._drop_report()
