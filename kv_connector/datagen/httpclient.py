"""A small JSON-over-HTTP client for a vLLM OpenAI server, over TCP or a Unix socket.

``http://HOST:PORT`` or ``unix:/path/to/socket`` (vLLM's ``--uds``): a server on a Unix
socket needs no port at all, so nothing is picked, released and bound later. Standard
library only; one connection per request, safe to use from several threads.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any
from urllib.parse import urlsplit

from kv_connector.common.errors import ConfigurationError, RefusedError


class HTTPError(RefusedError):
    """The server answered with a status other than 2xx."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Server:
    """Where a server listens: ``http://HOST:PORT`` or ``unix:/path``."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        if self.url.startswith("unix:"):
            self._unix: str | None = self.url.removeprefix("unix:")
            if not self._unix:
                raise ConfigurationError(f"{url!r}: a unix: address needs a socket path")
            self._host, self._port = "", 0
        else:
            parts = urlsplit(self.url)
            if parts.scheme != "http" or not parts.hostname:
                raise ConfigurationError(f"{url!r} is neither http://HOST:PORT nor unix:/path/to/socket")
            self._unix = None
            self._host, self._port = parts.hostname, parts.port or 80

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._unix is not None:
            return _UnixConnection(self._unix, timeout)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float = 300.0,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """(status, body bytes); raises OSError when the server cannot be reached."""
        conn = self._connection(timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            kind = {"Content-Type": "application/json"} if data is not None else {}
            headers = {**kind, **(headers or {})}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post_json(
        self, path: str, body: Any, timeout: float = 300.0, headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        status, data = self.request("POST", path, body, timeout, headers)
        if not 200 <= status < 300:
            raise HTTPError(status, data.decode(errors="replace"))
        result: dict[str, Any] = json.loads(data)
        return result

    def get_text(self, path: str, timeout: float = 30.0) -> str:
        status, data = self.request("GET", path, None, timeout)
        if not 200 <= status < 300:
            raise HTTPError(status, data.decode(errors="replace"))
        return data.decode()

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            return self.request("GET", "/health", None, timeout)[0] == 200
        except (OSError, http.client.HTTPException):
            return False
