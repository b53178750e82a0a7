"""A trainer rank's fetch agent: one process that fetches pulled samples for the whole rank.

It owns the rank's only NIXL agent and its only registered receive pool, and serves every
DataLoader worker, thread or process of the rank.

    rank (the trainer's process)  --starts-->  fetch agent (this module, a process)
      DataLoader worker 0..N-1    --Unix socket (agent.wire)-->  fetch agent
      each worker maps the agent's pool (a memory file passed over the socket)

The agent READs a sample once, with a ``PullClient`` whose pool lies in a memory file
(``shared_pool=True``). It checks the sample and releases it at the producer, as
``PullClient.fetch`` does, and tells the asking client where the sample lies in the pool.
The client copies it out (the one copy) and says it is done, and the pages go back. A
client that goes away (a worker killed) has its leases ended when its connection closes.
The agent ends when the rank does. It reads its standard input, which the rank holds, and
exits at its end; the rank exiting, however it exits, closes it.

``agent.client.FetchAgentProcess`` runs it as ``python -m kv_connector.reader.agent.fetch_agent``.
Its configuration comes as one JSON line on standard input. It answers with one JSON line on
standard output: ``{"address": ...}`` once it serves, or ``{"error": ...}``. It logs each
start phase's wall and CPU time (``START_PHASES``). A start longer than ``SLOW_START_S``
warns, naming the slowest phase.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from kv_connector.common.phases import Phase, Phases
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
from kv_connector.reader.pool.lease import Sample
from kv_connector.reader.pull.client import FetchError, PullClient
from kv_connector.wire.protocol import ProtocolError

log = logging.getLogger("kv_connector.fetch_agent")

SOCKET_NAME = "agent.sock"
MAX_CLIENTS = 1024
# what a start goes through, in order (each logged with its wall and CPU time)
START_PHASES = (
    # from the rank's spawn to this module's main()
    "interpreter and imports",
    "NIXL import",
    "NIXL agent",
    "UCX",
    # the memory file made and faulted in
    "pool allocation",
    "pool registration",
    # the socket bound and its thread started
    "serving",
)
# a start slower than this logs a warning naming its slowest phase
SLOW_START_S = 5.0


class FetchAgent:
    """Serves fetches from one ``PullClient`` with a shared pool to every client of ``address``.

    ``address`` is a Unix socket in a directory only this user can enter."""

    def __init__(self, config: AgentConfig, lap: Callable[[str], object] | None = None) -> None:
        """``lap`` is called with each start phase's name as it ends (``START_PHASES``)."""
        lap = lap or (lambda _name: None)
        self.config = config
        secret = bytes.fromhex(config.secret_hex) if config.secret_hex is not None else None
        self.client = PullClient(msgspec.structs.replace(config.options, shared_pool=True), secret=secret)
        # the one NIXL agent and the one registration, now
        self.client.open(lap)
        self.address = str(Path(config.socket_dir) / SOCKET_NAME)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(MAX_CLIENTS)
        self._lock = threading.Lock()
        self._next_lease = 0
        self._closed = False
        counts = ("connections", "clients_seen", "fetched", "failed", "leases_held", "freed_by_disconnect")
        self._counts = dict.fromkeys(counts, 0)
        self._thread = threading.Thread(target=self._accept, name="fetch-agent-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stats(self) -> AgentStats:
        with self._lock:
            return AgentStats(
                pid=os.getpid(),
                agent_name=self.client.name,
                registered_bytes=self.client.registered_bytes,
                **self._counts,
            )

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.address)
        # the rank made it; a rank that exits without close() leaves it
        with contextlib.suppress(OSError):
            os.rmdir(self.config.socket_dir)
        self.client.close()

    # ------------------------------------------------------------------ serving
    def _count(self, key: str, delta: int = 1) -> None:
        with self._lock:
            self._counts[key] += delta

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="fetch-agent-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        leases: dict[int, Sample] = {}
        self._count("connections")
        self._count("clients_seen")
        try:
            pool_fd = self.client.pool_fd
            assert pool_fd is not None
            hello = AgentHello(AGENT_VERSION, self.client.registered_bytes, self.client.name, os.getpid())
            socket.send_fds(conn, [frame(hello)], [pool_fd])
            reader = FrameReader()
            while True:
                msg = reader.next()
                if msg is None:
                    data = conn.recv(1 << 16)
                    if not data:
                        return
                    reader.feed(data)
                    continue
                answer = self._answer(msg, leases)
                if answer is not None:
                    conn.sendall(frame(answer))
        except (OSError, ValueError) as e:
            log.debug("fetch agent: a client went away: %s", e)
        finally:
            conn.close()
            self._count("connections", -1)
            if leases:
                log.info("fetch agent: a client went away holding %d samples: pages back", len(leases))
                self._count("freed_by_disconnect", len(leases))
                self._count("leases_held", -len(leases))
                for s in leases.values():
                    s.release()

    def _answer(self, msg: AgentMessage, leases: dict[int, Sample]) -> AgentMessage | None:
        if isinstance(msg, AgentFetch):
            return self._fetch(msg, leases)
        if isinstance(msg, AgentDone):
            s = leases.pop(msg.lease, None)
            if s is not None:
                s.release()
                self._count("leases_held", -1)
            return None
        if isinstance(msg, AgentRelease):
            try:
                self.client.release(msg.handle)
            except FetchError as e:
                return AgentFailed(e.code, str(e))
            return AgentOk()
        if isinstance(msg, AgentAsk):
            return self.stats()
        raise ProtocolError(f"a client sent {type(msg).__name__}")

    def _fetch(self, msg: AgentFetch, leases: dict[int, Sample]) -> AgentMessage:
        try:
            s = self.client.fetch(msg.handle, release=msg.release)
        except FetchError as e:
            self._count("failed")
            return AgentFailed(e.code, e.message)
        hidden = s.hidden_states
        with self._lock:
            self._next_lease += 1
            lease = self._next_lease
            self._counts["fetched"] += 1
            self._counts["leases_held"] += 1
        leases[lease] = s
        return AgentSample(
            lease=lease,
            request_id=s.request_id,
            producer_id=s.producer_id,
            sample_id=s.sample_id,
            token_ids=s.token_ids.tolist(),
            layer_ids=list(s.layer_ids),
            metadata=s.metadata,
            dtype=str(hidden.dtype).removeprefix("torch."),
            shape=list(hidden.shape),
            stride=list(hidden.stride()),
            offset=self.client.pool_offset(hidden),
            provenance=s.provenance,
        )


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def queued_s() -> float | None:
    """Seconds this process's main thread has waited, runnable, for a core since it began.

    It is Linux's run-queue delay (``/proc/self/schedstat``); None where the kernel does
    not count it."""
    try:
        with open("/proc/self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def log_start(agent: FetchAgent, phases: Phases) -> None:
    """Logs one line: what serves and how long each start phase took.

    A start longer than ``SLOW_START_S`` logs a warning naming the slowest phase."""

    log.info(
        "fetch agent %d: NIXL agent %s, %d MiB pool registered, serving at %s; started in %.1f s: %s",
        os.getpid(),
        agent.client.name,
        agent.client.registered_bytes >> 20,
        agent.address,
        phases.total_s,
        phases.describe(),
    )
    slowest = phases.slowest()
    if slowest is None or phases.total_s <= SLOW_START_S:
        return
    log.warning(
        "fetch agent %d: a slow start (%.1f s, more than %.0f s): %s took %.1f s%s",
        os.getpid(),
        phases.total_s,
        SLOW_START_S,
        slowest.name,
        slowest.wall_s,
        _why_slow(slowest),
    )


def _why_slow(phase: Phase) -> str:
    """What a slow phase did with its time: worked, waited for a core, or was blocked."""
    if phase.cpu_s is None or phase.cpu_s >= phase.wall_s / 2:
        return ", most of it on a CPU"
    if phase.queued_s is not None and phase.queued_s >= (phase.wall_s - phase.cpu_s) / 2:
        return (
            f", {phase.cpu_s:.1f} s of it on a CPU and {phase.queued_s:.1f} s waiting for one: "
            "the host's cores were busy (a producer on this host holding samples, or other processes)"
        )
    return f", {phase.cpu_s:.1f} s of it on a CPU: the process was blocked"


def main() -> int:
    # interpreter and imports are behind us
    begun_at, begun_cpu, begun_queued = time.time(), time.process_time(), queued_s()
    phases = Phases(time.monotonic, time.process_time, queued_s)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = msgspec.json.decode(sys.stdin.readline().encode(), type=AgentConfig)
        if config.spawned_at is not None:
            phases.add(START_PHASES[0], begun_at - config.spawned_at, begun_cpu, begun_queued)
        agent = FetchAgent(config, phases.lap)
        agent.start()
        phases.lap("serving")
    # said to the rank, which raises it
    except Exception as e:
        _say({"error": f"{type(e).__name__}: {e}", "phases": phases.as_dict()})
        return 1
    log_start(agent, phases)
    _say(
        {
            "address": agent.address,
            "pid": os.getpid(),
            "agent_name": agent.client.name,
            "phases": phases.as_dict(),
        }
    )
    try:
        # the rank holds the other end; it ends when the rank does
        while sys.stdin.readline():
            pass
    finally:
        log.info("fetch agent %d: the rank is gone or closed it: %s", os.getpid(), agent.stats())
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
