"""The project's errors: one root, ``KvConnectorError``, and a branch for each kind of failure.

A caller catches the root for "the connector failed", or one branch for one kind of failure.
Every error class of ``kv_connector`` and ``hybrid`` derives from exactly one branch. Each
branch keeps the builtin base its members were raised as before: ``ConfigurationError`` and
``IntegrityError`` are ``ValueError``s, the other four ``RuntimeError``s, so an ``except
ValueError`` written before the family still catches what it caught. Standard library only:
every package of the project may import it, ``hybrid`` included.
"""

from __future__ import annotations


class KvConnectorError(Exception):
    """The connector failed: the root of every error the project raises."""


class ConfigurationError(KvConnectorError, ValueError):
    """An option, argument or setup the connector cannot work with: fix it, a retry fails again.

    Bad options and arguments, a vLLM version or model the design does not serve, a device
    that is missing, an address already in use, a disk that is full or read-only."""


class WireError(KvConnectorError, RuntimeError):
    """A link to another process failed: a connection, a message, a NIXL transfer, the fetch agent."""


class IntegrityError(KvConnectorError, ValueError):
    """Data is not what it claims: a checksum, fingerprint, slot, values, fence or audit check failed."""


class RefusedError(KvConnectorError, RuntimeError):
    """The other side said no: a producer refusing a pull, a reader refusing a handshake, a server's error."""


class ClosedError(KvConnectorError, RuntimeError):
    """Used after its end: a closed reader, connection or endpoint, a released sample."""


class StateError(KvConnectorError, RuntimeError):
    """A call its object's state does not allow: a transition its table lacks, a lease past the limit."""


BRANCHES: tuple[type[KvConnectorError], ...] = (
    ConfigurationError,
    WireError,
    IntegrityError,
    RefusedError,
    ClosedError,
    StateError,
)

__all__ = [
    "BRANCHES",
    "ClosedError",
    "ConfigurationError",
    "IntegrityError",
    "KvConnectorError",
    "RefusedError",
    "StateError",
    "WireError",
]
