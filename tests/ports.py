"""Ports for tests, held from the moment they are chosen.

A test that needs an address before anything listens on it (a reader that starts late,
a reader that never starts, a reader restarted on the same address) binds a socket to
port 0 and keeps it: bound but not listening, the port stays ours and every connection
to it is refused (as for a reader that is not up). The reader, when it starts, takes
that same socket (``HiddenStatesReader(listen=sock)``, or ``--listen-fd`` for the CLI),
so the port is never released and rebound: no other process can take it in between.
"""

from __future__ import annotations

import socket

from kv_connector.wire.control import format_address


def held_port(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a free port on ``host``, not listening. Close it when done."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    return sock


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return format_address(host, port)
