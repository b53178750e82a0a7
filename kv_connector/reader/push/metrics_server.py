"""A Prometheus endpoint: ``GET /metrics`` over HTTP on a thread of its own, serving the
collectors it is given (its own registry, so several readers in one process never mix).

It listens on ``HOST:PORT`` (port 0: a free one, which ``address`` then names: nothing
is picked and bound later) or on a TCP socket the caller already bound. prometheus_client
is imported when a server is made: a reader without metrics (and the GPU check's device
tier, on a machine without it) never needs it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING

from kv_connector.common.errors import ConfigurationError
from kv_connector.wire.control import format_address, parse_address

if TYPE_CHECKING:
    from prometheus_client.registry import Collector


class MetricsAddressError(OSError, ConfigurationError):
    """The metrics endpoint cannot listen where it was asked to. ``OSError`` comes first, so
    that its two arguments are still ``errno`` and ``strerror``."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class MetricsServer:
    def __init__(self, listen: str | socket.socket, collectors: Iterable[Collector] = ()) -> None:
        from prometheus_client.exposition import MetricsHandler
        from prometheus_client.registry import CollectorRegistry

        self.registry = CollectorRegistry()
        for c in collectors:
            self.registry.register(c)
        handler = MetricsHandler.factory(self.registry)
        if isinstance(listen, socket.socket):
            if listen.type != socket.SOCK_STREAM or listen.getsockname()[1] == 0:
                raise ConfigurationError("the metrics socket must be a bound TCP socket")
            server = _Server(listen.getsockname()[:2], handler, bind_and_activate=False)
            server.socket.close()
            server.socket = listen
            server.server_address = listen.getsockname()[:2]
            server.server_activate()
        else:
            host, port = parse_address(listen)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            cls = type("_Server6", (_Server,), {"address_family": family})
            try:
                server = cls((host, port), handler)
            except OSError as e:
                raise MetricsAddressError(
                    e.errno, f"cannot serve metrics on {listen}: {e.strerror or e}"
                ) from e
        self._server = server
        bound = server.server_address
        self.address = format_address(str(bound[0]), int(bound[1]))
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="hs-metrics", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def register(self, collector: Collector) -> None:
        self.registry.register(collector)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
