"""Control connections: length-prefixed msgpack frames over TCP (tagged with the
session's MAC once the handshake set one), and address parsing."""

from __future__ import annotations

import contextlib
import ipaddress
import select
import socket
import struct
import threading
import time

from kv_connector.common.errors import ClosedError, ConfigurationError, WireError
from kv_connector.wire import auth, fields, protocol
from kv_connector.wire.protocol import ProtocolError

_LEN = struct.Struct(">I")
# what ``send_nowait`` may hold for a peer that does not read
MAX_OUT_BYTES = 4 << 20


class ConnectionClosed(ClosedError):
    """The peer closed the control connection."""


class OutputFull(WireError):
    """A peer stopped reading: more than ``max_out`` bytes wait to be sent to it."""


def is_loopback(host: str) -> bool:
    """Only this machine can reach ``host`` (a bound address, or "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); raise ValueError if malformed."""
    host, sep, port_s = text.rpartition(":")
    if not sep or not host:
        raise ConfigurationError(f"address {text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigurationError(f"address {text!r} has a non-numeric port") from None
    if not 0 <= port <= 65535:
        raise ConfigurationError(f"address {text!r} has a port outside 0-65535")
    return host, port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class FramedConnection:
    """One control connection. ``send`` blocks (with a timeout); ``receive`` returns the
    complete messages already readable without blocking. A frame longer than
    ``max_frame`` (which the handshake lowers while the peer has proven nothing) is a
    ``ProtocolError`` before any of it is buffered beyond one read."""

    def __init__(self, sock: socket.socket, send_timeout: float = 30.0) -> None:
        self.sock = sock
        self.max_frame = fields.MAX_FRAME_BYTES
        # set after an authenticated handshake
        self.mac: auth.SessionMac | None = None
        self.max_out = MAX_OUT_BYTES
        self._out = bytearray()
        # frames are sealed with a sequence number: sealing and sending are one step, so
        # threads that share a connection cannot reorder them
        self._send_lock = threading.Lock()
        sock.settimeout(send_timeout)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self.closed = False

    @classmethod
    def connect(cls, address: str, timeout: float = 10.0) -> FramedConnection:
        host, port = parse_address(address)
        sock = socket.create_connection((host, port), timeout=timeout)
        return cls(sock)

    def _frame(self, msg: protocol._Msg) -> bytes:
        data = protocol.encode(msg)
        if self.mac is not None:
            data = self.mac.seal(data)
        return _LEN.pack(len(data)) + data

    def send(self, msg: protocol._Msg) -> None:
        """Send one message, blocking (up to the socket's timeout); thread-safe."""
        with self._send_lock:
            self.flush_blocking()
            self.sock.sendall(self._frame(msg))

    def send_nowait(self, msg: protocol._Msg) -> None:
        """Queue one message and send what the socket takes now, never blocking; raise
        ``OutputFull`` when more than ``max_out`` bytes are left waiting (the peer does
        not read), ``ConnectionClosed`` when the peer is gone."""
        with self._send_lock:
            self._out += self._frame(msg)
        self.flush()
        if len(self._out) > self.max_out:
            raise OutputFull(f"{len(self._out)} bytes wait for a peer that does not read")

    @property
    def pending_out(self) -> int:
        return len(self._out)

    def never_block(self) -> None:
        """Put the socket in non-blocking mode (a serving loop's connections): with a
        timeout set, Python waits for a full socket to drain before even trying a send,
        whatever the flags say."""
        self.sock.setblocking(False)

    def flush(self) -> bool:
        """Send what the socket takes now (without blocking once ``never_block`` was
        called); True when nothing waits."""
        while self._out:
            try:
                n = self.sock.send(self._out, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                raise ConnectionClosed(str(e)) from None
            del self._out[:n]
        return True

    def flush_blocking(self) -> None:
        if self._out:
            self.sock.sendall(self._out)
            self._out.clear()

    def receive(self) -> list[protocol.Message]:
        """Read once and return the complete messages (call only when readable)."""
        self.fill()
        out: list[protocol.Message] = []
        while (msg := self.receive_buffered()) is not None:
            out.append(msg)
        return out

    def receive_one(self, timeout: float) -> protocol.Message:
        """Block up to ``timeout`` seconds in all for exactly the next message (handshakes):
        a peer trickling bytes does not extend the deadline."""
        deadline = time.monotonic() + timeout
        pending = self.receive_buffered()
        if pending is not None:
            return pending
        while True:
            left = deadline - time.monotonic()
            r, _, _ = select.select([self.sock], [], [], max(0.0, left)) if left > 0 else ([], [], [])
            if not r:
                raise TimeoutError("no complete message from the peer in time")
            self.fill()
            pending = self.receive_buffered()
            if pending is not None:
                return pending

    def fill(self) -> None:
        """Read what is there (call only when readable); ``receive_buffered`` then parses
        one frame at a time, each under the ``max_frame`` of the moment."""
        try:
            chunk = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            # nothing to read after all
            return
        except OSError as e:
            raise ConnectionClosed(str(e)) from None
        if not chunk:
            raise ConnectionClosed("peer closed the connection")
        self._buf += chunk

    def receive_buffered(self) -> protocol.Message | None:
        if len(self._buf) < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(self._buf)
        if n > self.max_frame:
            raise ProtocolError(f"frame of {n} bytes exceeds {self.max_frame}")
        if len(self._buf) < _LEN.size + n:
            return None
        frame = bytes(self._buf[_LEN.size : _LEN.size + n])
        del self._buf[: _LEN.size + n]
        if self.mac is not None:
            opened = self.mac.open(frame)
            if opened is None:
                raise ProtocolError(
                    "a control message failed its integrity check (forged, replayed or reordered)"
                )
            frame = opened
        return protocol.decode(frame)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()
