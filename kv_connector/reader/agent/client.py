"""The rank's side of its fetch agent (``reader.agent.fetch_agent``): a process and its client.

One agent serves every thread and process of the rank, so the rank registers one pool.
``FetchAgentProcess`` starts the agent and holds it; the agent ends when the rank does.
``AgentClient`` fetches through it from any thread or process of the rank. A DataLoader
worker gets it pickled, which carries its address only.

``AgentClient.fetch(handle)`` asks the agent for the sample. The agent READs it into its
pool, checks it and releases it at the producer. The client maps the agent's pool once per
process; the memory file comes over the socket. It copies the sample out, the one copy: the
tensor is the caller's, contiguous [T, L, H]. Then it tells the agent the pages may go back.
Each thread has a connection of its own; a process's connections share one mapping.

A sample the rank was handed before its agent serves is kept at its producer while the agent
starts; it is the first row a rank fetches itself. ``start(keep=[params])`` runs a
``HoldKeeper`` until the agent answers, so a slow start does not let ``pull_timeout_s`` free
the sample. Each producer keeps it at most twice ``pull_timeout_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

import kv_connector
from kv_connector.common.errors import WireError
from kv_connector.common.memory import map_shared
from kv_connector.reader.agent.hold_keeper import HoldKeeper, KeptHolds
from kv_connector.reader.agent.wire import (
    AGENT_VERSION,
    AgentAsk,
    AgentConfig,
    AgentDone,
    AgentFailed,
    AgentFetch,
    AgentHello,
    AgentMessage,
    AgentOk,
    AgentRelease,
    AgentSample,
    AgentStats,
    FrameReader,
    frame,
)
from kv_connector.reader.options import AGENT_POOL_BYTES, options_of
from kv_connector.reader.pool.lease import COPY_BUFFERS_MIN_BYTES, CopyBuffers, Sample
from kv_connector.reader.pull.links import FetchError
from kv_connector.reader.pull.options import PullOptions
from kv_connector.wire.handle import HandleError, handle_of

# importing torch and NIXL, registering the pool
AGENT_START_TIMEOUT_S = 120.0
# a start slower than this is named when a sample expired meanwhile
SLOW_START_S = 5.0


class FetchAgentError(WireError):
    """The fetch agent could not be started, or is gone."""


class FetchAgentProcess:
    """A rank's fetch agent, run in a process of its own.

    ``start()`` starts it, or the first use of ``address`` does; ``close()`` or the end of
    this process ends it."""

    def __init__(
        self, options: PullOptions | None = None, *, secret: bytes | None = None, **keywords: Any
    ) -> None:
        """``options``: the agent's ``PullOptions``, or their fields as keywords, not both.

        Its pool is shared with the rank's workers whatever ``shared_pool`` says. Given as
        keywords, the pool is ``AGENT_POOL_BYTES`` by default. ``secret``: as ``PullClient``'s."""
        keywords = keywords if options is not None else {"pool_bytes": AGENT_POOL_BYTES, **keywords}
        options = options_of(PullOptions, options, keywords)
        # its NIXL agent's name, also what keeps of its first samples announce
        self.name = options.name or f"fetch-agent-{uuid.uuid4().hex[:12]}"
        self.options = msgspec.structs.replace(options, name=self.name, shared_pool=True)
        self._secret = secret
        self._proc: subprocess.Popen[str] | None = None
        self._dir: str | None = None
        self._address: str | None = None
        self._lock = threading.Lock()
        self.pid: int | None = None
        # how long each phase of the agent's start took: {phase: {"wall_s", "cpu_s", "queued_s"}}
        self.start_phases: dict[str, dict[str, float | None]] = {}
        # from its spawn to its answer, as this process saw it
        self.start_s: float | None = None
        # what was kept while it started
        self.kept = KeptHolds()

    @property
    def address(self) -> str:
        """Where the agent serves (started now if it is not yet)."""
        self.start()
        assert self._address is not None
        return self._address

    def start(self, keep: Iterable[str | Mapping[str, Any]] = ()) -> None:
        """Start the agent now, if it is not started (``FetchAgentError`` if it cannot).

        ``keep``: handles, or responses' ``kv_transfer_params``, of samples this rank was
        handed and will fetch through the agent. Their producers keep them held while the
        agent starts (``HoldKeeper``); ``kept`` says what it did."""
        with self._lock:
            if self._proc is not None:
                if self._proc.poll() is not None:
                    code = self._proc.returncode
                    raise FetchAgentError(f"the fetch agent (pid {self.pid}) exited with {code}")
                return
            # only this user can enter it
            self._dir = tempfile.mkdtemp(prefix="kv-fetch-agent-")
            config = AgentConfig(
                socket_dir=self._dir,
                options=self.options,
                secret_hex=None if self._secret is None else self._secret.hex(),
                spawned_at=time.time(),
            )
            t0 = time.monotonic()
            root = str(Path(kv_connector.__file__).resolve().parent.parent)
            paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
            proc = subprocess.Popen(
                [sys.executable, "-m", "kv_connector.reader.agent.fetch_agent"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(msgspec.json.encode(config).decode() + "\n")
            proc.stdin.flush()
            keeper = HoldKeeper(
                keep, self.name, self.options.pool_bytes, self._secret, min(self.options.timeout_s, 10.0)
            )
            try:
                keeper.start()
                ready, _, _ = select.select([proc.stdout], [], [], AGENT_START_TIMEOUT_S)
                line = proc.stdout.readline() if ready else ""
            finally:
                self.kept = keeper.stop()
            self.start_s = time.monotonic() - t0
            said: dict[str, Any] = json.loads(line) if line.strip() else {}
            if "address" not in said:
                proc.kill()
                proc.wait()
                silent = f"no answer in {AGENT_START_TIMEOUT_S:.0f} s (exit {proc.returncode})"
                why = said.get("error") or silent
                raise FetchAgentError(f"the fetch agent did not start: {why}")
            self._proc, self._address, self.pid = proc, str(said["address"]), int(said["pid"])
            self.start_phases = dict(said.get("phases") or {})

    def slow_start(self) -> str | None:
        """What made the agent's start slow, in a sentence; None within ``SLOW_START_S``.

        The sentence names its slowest phase and whether it waited for a core."""
        if self.start_s is None or self.start_s <= SLOW_START_S:
            return None
        name, p = max(self.start_phases.items(), key=lambda kv: kv[1].get("wall_s") or 0.0, default=("", {}))
        queued = p.get("queued_s")
        waited = f", {queued:.0f} s of it waiting for a core" if queued and queued >= 1.0 else ""
        slowest = f": {name} took {p.get('wall_s') or 0.0:.0f} s{waited}" if name else ""
        return f"this rank's fetch agent took {self.start_s:.0f} s to start{slowest}"

    def close(self, timeout: float = 10.0) -> None:
        """End the agent (its clients' fetches fail 'closed' from then on)."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is None:
                return
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            if self._dir is not None:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self._dir, "agent.sock"))
                with contextlib.suppress(OSError):
                    os.rmdir(self._dir)

    def __enter__(self) -> FetchAgentProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a FetchAgentProcess stays with its rank: pickle AgentClient(agent.address) instead")


def _handle(handle: str | Mapping[str, Any]) -> str:
    try:
        return handle_of(handle)
    except HandleError as e:
        raise FetchError("handle", str(e)) from None


class _Conn:
    def __init__(self, sock: socket.socket, hello: AgentHello, reader: FrameReader) -> None:
        self.sock = sock
        self.hello = hello
        self.reader = reader
        # a forked child makes its own (a connection is one conversation)
        self.pid = os.getpid()

    def send(self, msg: AgentMessage, timeout: float) -> None:
        # not what the last receive left of its deadline
        self.sock.settimeout(timeout)
        self.sock.sendall(frame(msg))

    def ask(self, msg: AgentMessage, timeout: float) -> AgentMessage:
        self.send(msg, timeout)
        return self.receive(timeout)

    def receive(self, timeout: float) -> AgentMessage:
        deadline = time.monotonic() + timeout
        while True:
            got = self.reader.next()
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the fetch agent did not answer in {timeout:.0f} s")
            self.sock.settimeout(left)
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the fetch agent closed the connection")
            self.reader.feed(data)


class AgentClient:
    """Fetches pulled samples through a rank's fetch agent at ``address`` (see the
    module's docstring). Picklable (its address travels; connections are made on use).
    ``timeout_s`` bounds one fetch beyond the agent's own timeout."""

    def __init__(self, address: str, timeout_s: float = 60.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._reset()

    def _reset(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        # the agent's pool, mapped here (uint8)
        self._pool: torch.Tensor | None = None
        # a thread's ends with the thread
        self._conns: weakref.WeakSet[_Conn] = weakref.WeakSet()
        self._copies = CopyBuffers(COPY_BUFFERS_MIN_BYTES)

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    # ------------------------------------------------------------------ public
    def fetch(self, handle: str | Mapping[str, Any], release: bool = True) -> Sample:
        """The sample named by ``handle`` or a response's ``kv_transfer_params``.

        The agent reads and checks it and releases it at its producer (unless
        ``release=False``); it is then copied out of the agent's pool. ``FetchError`` says
        why not ("agent" when the agent cannot be reached)."""

        conn = self._conn()
        got = self._ask(conn, AgentFetch(_handle(handle), release), self.timeout_s * 2)
        if isinstance(got, AgentFailed):
            raise FetchError(got.code, got.message)
        if not isinstance(got, AgentSample):
            raise FetchError("protocol", f"the fetch agent answered {type(got).__name__}")
        try:
            hidden = self._copy_out(got)
        finally:
            # if it fails, the agent ends the lease with the connection
            with contextlib.suppress(OSError):
                # the pages go back
                conn.send(AgentDone(got.lease), self.timeout_s)
        return Sample.of(got, hidden, got.producer_id, got.metadata)

    def release(self, handle: str | Mapping[str, Any]) -> None:
        """Let the producer free the sample's blocks (a sample released or gone already is
        no error)."""
        got = self._ask(self._conn(), AgentRelease(_handle(handle)), self.timeout_s)
        if isinstance(got, AgentFailed) and got.code != "released":
            raise FetchError(got.code, got.message)
        if not isinstance(got, AgentOk | AgentFailed):
            raise FetchError("protocol", f"the fetch agent answered {type(got).__name__}")

    def stats(self) -> AgentStats:
        """The agent's counts (its pid, its one NIXL agent, its registration, its clients)."""
        got = self._ask(self._conn(), AgentAsk(), self.timeout_s)
        if not isinstance(got, AgentStats):
            raise FetchError("protocol", f"the fetch agent answered {type(got).__name__}")
        return got

    def close(self) -> None:
        """Close this process's connections (their leases, if any, end)."""
        with self._lock:
            conns, self._conns = list(self._conns), weakref.WeakSet()
        for c in conns:
            with contextlib.suppress(OSError):
                c.sock.close()
        self._local = threading.local()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _ask(self, conn: _Conn, msg: AgentMessage, timeout: float) -> AgentMessage:
        try:
            return conn.ask(msg, timeout)
        # a broken connection: the next call makes a new one
        except (OSError, ValueError) as e:
            self._drop(conn)
            raise FetchError("agent", f"the fetch agent at {self.address}: {e}") from None

    def _drop(self, conn: _Conn) -> None:
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            self._conns.discard(conn)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _conn(self) -> _Conn:
        conn: _Conn | None = getattr(self._local, "conn", None)
        if conn is not None:
            if conn.pid == os.getpid():
                return conn
            # forked: the parent's connections and mapping are not this process's
            self._reset()
        return self._connect()

    def _connect(self) -> _Conn:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect(self.address)
            data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 1)
            reader = FrameReader()
            reader.feed(data)
            pending = _Conn(sock, AgentHello(0, 0, "", 0), reader)
            hello = pending.receive(self.timeout_s)
        except (OSError, ValueError) as e:
            sock.close()
            raise FetchError("agent", f"cannot reach the fetch agent at {self.address}: {e}") from None
        try:
            if not isinstance(hello, AgentHello) or hello.version != AGENT_VERSION or len(fds) != 1:
                sock.close()
                why = f"did not say hello as version {AGENT_VERSION} with its pool"
                raise FetchError("agent", f"the fetch agent at {self.address} {why}")
            with self._lock:
                if self._pool is None:
                    self._pool = torch.from_numpy(map_shared(fds[0], hello.pool_bytes))
        finally:
            for fd in fds:
                os.close(fd)
        conn = _Conn(sock, hello, reader)
        # a thread that ends closes its connection
        weakref.finalize(conn, sock.close)
        with self._lock:
            self._conns.add(conn)
        self._local.conn = conn
        return conn

    def _copy_out(self, sample: AgentSample) -> torch.Tensor:
        pool = self._pool
        assert pool is not None
        dtype = getattr(torch, sample.dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if sample.offset % itemsize or sample.offset < 0:
            raise FetchError(
                "protocol", f"the fetch agent placed sample {sample.request_id} at {sample.offset}"
            )
        typed = pool[: pool.numel() - pool.numel() % itemsize].view(dtype)
        start = sample.offset // itemsize
        last = start + sum((n - 1) * st for n, st in zip(sample.shape, sample.stride, strict=True) if n > 0)
        if len(sample.shape) != 3 or min(sample.stride, default=0) < 0 or last >= typed.numel():
            raise FetchError(
                "protocol", f"the fetch agent placed sample {sample.request_id} outside its pool"
            )
        view = typed.as_strided(sample.shape, sample.stride, start)
        nbytes = int(np.prod(sample.shape)) * itemsize
        out = self._copies.take(nbytes).view(dtype).view(sample.shape)
        out.copy_(view)
        return out


__all__ = ["AgentClient", "FetchAgentError", "FetchAgentProcess"]
