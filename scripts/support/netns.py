"""Test "nodes" as Linux network namespaces on one private L2 segment.

``Cluster`` makes a switch namespace holding a bridge and one namespace per node, each
joined to the bridge by a veth pair with an address in 10.231.X.0/24 (X picked per
cluster), loopback up. Processes started with ``run`` live inside a node; ``close`` (also
on exceptions, as a context manager) kills them and deletes every namespace it made.
Traffic stays inside these namespaces. Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, or no iproute2)."""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {r.stderr.strip()}")


def check_available() -> None:
    """Raise NetnsUnavailable with the reason if namespaces cannot be made here."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2's `ip` is not installed")
    if os.geteuid() != 0:
        raise NetnsUnavailable("creating network namespaces needs root")
    name = f"hsprobe{os.getpid()}"
    _ip("netns", "add", name)
    _ip("netns", "del", name)


@dataclass
class Node:
    name: str
    netns: str
    address: str


@dataclass
class Cluster:
    """Node namespaces on one bridge; use as a context manager."""

    tag: str = field(default_factory=lambda: f"hs{os.getpid() % 100000}")
    subnet: int = field(default_factory=lambda: 100 + os.getpid() % 150)
    nodes: dict[str, Node] = field(default_factory=dict)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_available()
        self.switch = f"{self.tag}sw"
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def _add_ns(self, name: str) -> None:
        with contextlib.suppress(NetnsUnavailable):
            _ip("netns", "del", name)  # a leftover of a killed earlier run
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_node(self, name: str) -> Node:
        idx = len(self.nodes) + 1
        ns = f"{self.tag}{name}"
        self._add_ns(ns)
        host_if, node_if = f"{self.tag}v{idx}", "eth0"
        _ip("link", "add", host_if, "type", "veth", "peer", "name", f"{self.tag}p{idx}")
        _ip("link", "set", host_if, "netns", self.switch)
        _ip("link", "set", f"{self.tag}p{idx}", "netns", ns)
        _ip("-n", ns, "link", "set", f"{self.tag}p{idx}", "name", node_if)
        _ip("-n", self.switch, "link", "set", host_if, "master", "br0")
        _ip("-n", self.switch, "link", "set", host_if, "up")
        address = f"10.231.{self.subnet}.{idx}"
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", node_if)
        _ip("-n", ns, "link", "set", node_if, "up")
        node = Node(name, ns, address)
        self.nodes[name] = node
        return node

    def run(
        self,
        node: Node,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        stdout: int | IO[Any] | None = subprocess.PIPE,
        stderr: int | IO[Any] | None = subprocess.PIPE,
    ) -> subprocess.Popen[str]:
        """Start ``argv`` inside ``node`` (UCX over TCP on its eth0: the same-host
        shortcuts would bypass the veth link)."""
        full_env = {
            **os.environ,
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": "eth0",
            **(env or {}),
        }
        p = subprocess.Popen(
            ["ip", "netns", "exec", node.netns, *argv],
            env=full_env,
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in reversed(self._made):
            with contextlib.suppress(NetnsUnavailable):
                _ip("netns", "del", ns)
        self._made.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
