"""The NIXL transport: the one module that imports nixl.

A ``NixlTransport`` is one NIXL agent on the UCX backend, without NIXL's progress thread
(it spins a whole core per agent; on small machines that starves vLLM). Progress is made
by the caller polling ``poll`` and ``notifications`` on both sides. It implements
``kv_connector.wire.transport.Transport``.

Before its UCX context exists, an agent gets the UCX settings GPU buffers need on one node
(``ucx_report.UCX_DEFAULTS``, through NIXL's ``engine_config``; never over a user's
``UCX_*``) and asks UCX to describe its WRITE and READ choices in files of a directory of
its own (``ucx_choices``); at the first completion of each kind of transfer it reads
them, records and logs the transport of each pairing, and warns where ``tcp`` carries a
GPU buffer. Where NIXL cannot be imported, the error names the wheel (``nixl_install``).

A reader whose pool is a memory file publishes it (``publish_pool``); a producer's agent
on the same node then maps it at ``add_peer`` and makes each WRITE into it a copy of its
own followed by a NIXL notification (``wire.node_pool``), reported as the ``node_pool``
transport of its pairing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kv_connector.common.device import DeviceEvent
from kv_connector.wire import node_pool, ucx_choices, ucx_report
from kv_connector.wire.nixl_install import install_hint
from kv_connector.wire.transport import MemType, Region, Transfer, TransportError

log = logging.getLogger(__name__)

_DONE, _PROC, _ERR = "DONE", "PROC", "ERR"

# a WRITE into a mapped pool is told by a NIXL WRITE of its last bytes again, from a slot
TAIL_BYTES = 64
TAIL_SLOTS = 1024


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


class _MappedWrite:
    """One WRITE done as a copy into a peer's mapped pool. Once the copy is done its
    notification rides a NIXL WRITE of the copy's last bytes again (``tail``: pool offset,
    length), so NIXL delivers it after the data and makes its progress as for any WRITE
    (a standalone notification has no completion to poll)."""

    __slots__ = ("done", "kind", "nbytes", "notif", "op", "peer", "remote", "slot", "tail", "tail_xfer")

    def __init__(
        self,
        done: DeviceEvent,
        peer: str,
        nbytes: int,
        notif: bytes,
        kind: tuple[str, ...],
        remote: Region,
        tail: tuple[int, int],
    ) -> None:
        self.done = done
        self.peer = peer
        self.nbytes = nbytes
        self.notif = notif
        self.op = "WRITE"
        self.kind = kind
        self.remote = remote
        self.tail = tail
        self.slot: int | None = None
        self.tail_xfer: _Transfer | None = None


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
        # (peer, op, local memory, remote memory): the first of each is reported
        self.kind = kind


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
        self.report_dir, self._own_report = ucx_choices.report_dir()
        params["engine_config"], applied = ucx_report.engine_config(
            os.environ, params.get("engine_config", ""), self.report_dir if self._own_report else None
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
        # report files read
        self._read: set[str] = set()
        # pairing -> transports, over all sizes
        self._every: dict[ucx_report.Pairing, set[str]] = {}
        self.name = name
        self.failed_polls = 0
        self._regs: dict[Region, Any] = {}
        self._peers: set[str] = set()
        # each registration's bytes, for mapped WRITEs
        self._tensors: dict[Region, torch.Tensor] = {}
        # peer -> its pool, mapped here
        self._mapped: dict[str, node_pool.MappedPool] = {}
        # the path of this agent's published pool
        self._offer: str | None = None
        # a GPU's stream of mapped WRITEs, made at the first
        self._copy_stream: Any = None
        # the notifications' WRITEs' bytes, a slot each
        self._tails: torch.Tensor | None = None
        self._tails_region: Region | None = None
        self._tail_slots = list(range(TAIL_SLOTS))

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
        self._tensors[region] = node_pool.byte_view(tensor)
        return region

    def publish_pool(self, region: Region, fd: int) -> None:
        """Offer ``region`` (registered here, host memory in the memory file ``fd``) to
        producers on this node, which then copy into it instead of WRITEs through UCX;
        withdrawn at ``close``. Nothing where ``KV_CONNECTOR_NODE_POOL`` is off."""
        if node_pool.switched_off(os.environ) or region.mem_type != "DRAM" or region not in self._regs:
            return
        offer = node_pool.make_offer(self.name, fd, region.addr, region.nbytes)
        self._offer = str(node_pool.publish(offer))
        log.info(
            "NIXL agent %s: pool of %d bytes offered to producers on this node", self.name, region.nbytes
        )

    def deregister(self, region: Region) -> None:
        """Release a registration made by ``register`` (before the memory is freed or
        remapped); the agent's ``metadata`` no longer names it. No WRITE may be in flight
        from it. Nothing happens for a region not registered."""
        reg = self._regs.pop(region, None)
        self._tensors.pop(region, None)
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
        if peer not in self._mapped and not node_pool.switched_off(os.environ):
            mapped, why = node_pool.attach(peer)
            if mapped is not None:
                self._mapped[peer] = mapped
                log.info(
                    "NIXL agent %s: %s's pool is on this node and mapped: WRITEs into it are copies",
                    self.name,
                    peer,
                )
            else:
                log.debug("NIXL agent %s: %s's pool not mapped: %s", self.name, peer, why)
        return peer

    def remove_peer(self, peer: str) -> None:
        mapped = self._mapped.pop(peer, None)
        if mapped is not None:
            mapped.close()
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
        data landed. Into a peer's pool mapped here, a copy of our own (``node_pool``)."""
        mapped = self._mapped.get(peer)
        if mapped is not None and remote.mem_type == "DRAM" and mapped.covers(remote.addr, remote.nbytes):
            return self._copy("WRITE", peer, mapped, local, remote, spans, notif)
        return self._post("WRITE", peer, local, remote, spans, notif)

    def _copy(
        self,
        op: str,
        peer: str,
        mapped: node_pool.MappedPool,
        local: Region,
        remote: Region,
        spans: Sequence[tuple[int, int, int]] | np.ndarray,
        notif: bytes,
    ) -> Transfer:
        arr = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
        if arr.size == 0:
            raise TransportError(f"a {op} needs at least one span")
        src = self._tensors.get(local)
        if src is None:
            raise TransportError(f"a {op} from memory not registered with {self.name}")
        rows = arr.copy()
        # offsets in the mapped pool
        rows[:, 1] += remote.addr - mapped.addr
        stream = None
        if src.device.type == "cuda":
            if not mapped.pin(src.device):
                return self._post(op, peer, local, remote, spans, notif)
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(src.device)  # type: ignore[no-untyped-call]
            stream = self._copy_stream
        try:
            done = node_pool.copy_spans(src, mapped.tensor, rows, stream)
        except (ValueError, RuntimeError) as e:
            raise TransportError(f"cannot copy a {op} into {peer}'s mapped pool: {e}") from e
        last = rows[-1]
        n = min(TAIL_BYTES, int(last[2]))
        # the last bytes written, as offsets in the pool
        tail = (int(last[1] + last[2]) - n, n)
        kind = (peer, op, local.mem_type, "mapped")
        return _MappedWrite(done, peer, int(arr[:, 2].sum()), notif, kind, remote, tail)

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
    ) -> _Transfer:
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
        if isinstance(xfer, _MappedWrite):
            return self._poll_mapped(xfer)
        assert isinstance(xfer, _Transfer)
        try:
            state = self._agent.check_xfer_state(xfer.handle)
        # e.g. nixlRemoteDisconnectError: the peer is gone
        except Exception as e:
            with contextlib.suppress(Exception):
                self._agent.release_xfer_handle(xfer.handle)
            raise TransportError(f"a {xfer.op} of {xfer.nbytes} bytes with {xfer.peer} failed: {e}") from None
        if state == _PROC:
            return False
        with contextlib.suppress(Exception):
            self._agent.release_xfer_handle(xfer.handle)
        if state == _DONE:
            # UCX chose its transport when it was posted
            if xfer.kind not in self._kinds:
                self._kinds.add(xfer.kind)
                try:
                    self.report_choices()
                # a report never fails a transfer
                except Exception as e:
                    log.debug("NIXL agent %s: UCX's report unread: %s", self.name, e)
            return True
        raise TransportError(f"a {xfer.op} of {xfer.nbytes} bytes with {xfer.peer} failed")

    def _poll_mapped(self, xfer: _MappedWrite) -> bool:
        if xfer.tail_xfer is None:
            if not xfer.done.query() or not self._tail_slots:
                return False
            if self._tails is None:
                self._tails = torch.zeros(TAIL_SLOTS * TAIL_BYTES, dtype=torch.uint8)
                self._tails_region = self.register(self._tails)
            assert self._tails_region is not None
            mapped = self._mapped.get(xfer.peer)
            if mapped is None:
                raise TransportError(f"{xfer.peer} was removed before a copy into its pool was told")
            slot = xfer.slot = self._tail_slots.pop()
            at, n = xfer.tail
            self._tails[slot * TAIL_BYTES : slot * TAIL_BYTES + n] = mapped.tensor[at : at + n]
            # the pool's offsets, as the remote region's
            base = mapped.addr - xfer.remote.addr
            span = [(slot * TAIL_BYTES, base + at, n)]
            try:
                xfer.tail_xfer = self._post(
                    "WRITE", xfer.peer, self._tails_region, xfer.remote, span, xfer.notif
                )
            except TransportError:
                self._free_slot(xfer)
                raise
            # not a pairing of its own: reported as node_pool's
            xfer.tail_xfer.kind = ()
            self._kinds.add(())
        try:
            # its handle released once done
            finished = self.poll(xfer.tail_xfer)
        except TransportError:
            self._free_slot(xfer)
            raise
        if not finished:
            return False
        self._free_slot(xfer)
        if xfer.kind not in self._kinds:
            self._kinds.add(xfer.kind)
            local = ucx_report.Mem.GPU if xfer.kind[2] == "VRAM" else ucx_report.Mem.HOST
            pairing = ucx_report.Pairing(
                ucx_report.Op.WRITE, local, ucx_report.Mem.HOST, ucx_report.Reach.SAME_NODE
            )
            ucx_choices.record(self.name, pairing, [node_pool.TRANSPORT])
            log.info("NIXL agent %s: a %s is a copy into %s's mapped pool", self.name, pairing, xfer.peer)
        return True

    def _free_slot(self, xfer: _MappedWrite) -> None:
        if xfer.slot is not None:
            self._tail_slots.append(xfer.slot)
            xfer.slot = None

    def notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as (peer name, message); also makes UCX progress."""
        out: list[tuple[str, bytes]] = []
        try:
            notifs = self._agent.get_new_notifs()
        # a peer's disconnect surfaces here too
        except Exception as e:
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
            path = os.path.join(self.report_dir or "", file_name)
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                continue
            self._read.add(file_name)
            # read once: nothing is left behind the agent
            if self._own_report:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            c = ucx_report.choice_of(file_name, text, self.name)
            # its loopback
            if c is not None and c.pairing.reach is not ucx_report.Reach.SELF:
                choices.append(c)
                self._every.setdefault(c.pairing, set()).update(c.transports)
        new: dict[ucx_report.Pairing, tuple[str, ...]] = {}
        for pairing, found in ucx_report.bulk(choices).items():
            if (grown := ucx_choices.record(self.name, pairing, found)) is not None:
                new[pairing] = grown
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

    def rdma_into(self, op: ucx_report.Op, local: ucx_report.Mem) -> bool | None:
        """Whether UCX chose an RDMA transport (``ucx_report.any_rdma``) for any size of
        ``op`` into this agent's ``local`` memory, as its report said; None while it said
        nothing of such a transfer (no report, or none completed yet)."""
        seen = [ts for p, ts in self._every.items() if p.op is op and p.local is local]
        if not seen:
            return None
        return ucx_report.any_rdma(t for ts in seen for t in ts)

    def _report_files(self) -> list[str]:
        if self.report_dir is None:
            return []
        try:
            names = os.listdir(self.report_dir)
        # UCX makes the directory at its first description
        except OSError:
            return []
        prefix = ucx_report.sanitized(self.name) + "_"
        return sorted(n for n in names if n.startswith(prefix) and n.endswith(".dot") and n not in self._read)

    def _drop_report(self) -> None:
        if self._own_report and self.report_dir is not None:
            shutil.rmtree(self.report_dir, ignore_errors=True)
            self._own_report = False

    def close(self) -> None:
        if self._offer is not None:
            node_pool.withdraw(Path(self._offer))
            self._offer = None
        for peer in list(self._peers):
            self.remove_peer(peer)
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        self._tensors.clear()
        for reg in self._regs.values():
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.warning("deregistering NIXL memory failed: %s", e)
        self._regs.clear()
        self._drop_report()
