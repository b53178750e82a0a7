"""The options every client of the reader shares, declared, defaulted and checked once.

``ClientOptions`` is a msgspec Struct, as the producer's ``ConnectorOptions`` is. The push
reader's ``ReaderConfig``, the pull client's ``PullOptions`` and the fetch agent extend it.
So a pool, its device, the checks and the hand-out are named the same way whichever client
a user runs. Each field's type says what it takes, bounds included (``msgspec.Meta``), and
msgspec checks it: ``Options.of(**fields)`` converts untyped values (a kind as its string,
as a command line has it), and a record built directly must hold its types already. A bad
value raises ``ConfigurationError`` (a ``ValueError``) naming the field when the record is
built; ``__post_init__`` adds only what involves two fields.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, get_type_hints

import msgspec

from kv_connector.common.errors import ConfigurationError, KvConnectorError
from kv_connector.wire.provenance import Expectation

# A client's receive pool holds the samples on their way and those on lease: the push
# reader's producers WRITE several at once, and a pull client's ``fetch_iter`` READs four
# ahead; 256 MiB holds four 64 MiB samples (4k tokens of 2 layers of 4096 in bf16).
DEFAULT_POOL_BYTES = 256 << 20
# A rank's fetch agent has one pool for every DataLoader worker of the rank.
AGENT_POOL_BYTES = 1 << 30

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
if TYPE_CHECKING:
    BoundSocket = socket.socket
else:
    # msgspec checks no union of str with a type it does not know: a field that takes an
    # address or a bound socket takes the socket as it is, and its client checks it
    BoundSocket = Any

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(kind: type) -> dict[str, Any]:
    if kind not in _HINTS:
        _HINTS[kind] = get_type_hints(kind, include_extras=True)
    return _HINTS[kind]


class ClientOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every client is configured with; each client adds its own fields.

    ``name``: the client's name at producers and in logs (default: a random one).
    ``pool_bytes``: the receive pool, registered with NIXL once. The samples on their way
    and those on lease share it.
    ``pool_device``: None (default) keeps the pool in host memory. ``"cuda:N"`` puts it on
    that GPU, registered as VRAM. Samples then land, are checked and are views there, and
    their pages return in stream order. ``"cpu"`` runs that device code on host memory,
    which is what CI tests. ``PoolDeviceError`` when CUDA or the GPU is missing.
    ``copy``: hand samples out as copies, into reused buffers, instead of views of the pool
    on lease. Their pages return at once. For users who keep samples for long.
    ``check_values`` (default on): refuse a sample whose states hold NaN/Inf, tokens zero in
    every layer or layers zero at every token (``reader.pool.values``). On a host pool it is
    a sampled screen, and the whole sample is looked at only where it shows something. On a
    GPU pool it is a full pass there. ``full_values_check`` reads every value on the host too.
    ``expect``: what every sample must be (``wire.provenance.Expectation``: layer ids,
    dtype, hidden size, model). One that differs is refused by name before its bytes move.
    """

    pool_bytes: PositiveInt = DEFAULT_POOL_BYTES
    name: str | None = None
    pool_device: str | None = None
    copy: bool = False
    check_values: bool = True
    full_values_check: bool = False
    expect: Expectation | None = None

    @classmethod
    def of(cls: type[Options], **fields: Any) -> Options:
        """The record of untyped values (a kind as its string: ``ack="manual"``), each
        converted to its field's type by msgspec; ``ConfigurationError`` naming a bad one,
        ``TypeError`` for a name that is no field (as a call with an unknown keyword)."""
        unknown = sorted(set(fields) - set(cls.__struct_fields__))
        if unknown:
            known = sorted(cls.__struct_fields__)
            raise TypeError(f"{cls.__name__} has no field {unknown}; its fields: {known}")
        try:
            return msgspec.convert(fields, cls)
        except msgspec.ValidationError as e:
            if isinstance(e.__cause__, KvConnectorError):
                # raised by a record's own check (msgspec wraps it): the error itself
                raise e.__cause__ from None
            raise ConfigurationError(f"{cls.__name__}: {e}") from None

    def __post_init__(self) -> None:
        # a record built directly holds its fields' types (``of`` converts): msgspec checks
        # each value against its type and bounds, as ``of`` does
        for name, hint in _hints(type(self)).items():
            value = getattr(self, name)
            if hint is Any or name not in self.__struct_fields__:
                continue
            try:
                got = msgspec.convert(value, hint)
            except msgspec.ValidationError as e:
                raise ConfigurationError(f"{type(self).__name__}.{name}: {e}, got {value!r}") from None
            if got != value or (isinstance(got, enum.Enum) and got is not value):
                raise ConfigurationError(
                    f"{type(self).__name__}.{name} takes a {type(got).__name__}, got {value!r}: pass "
                    f"{got!r}, or build the record with {type(self).__name__}.of({name}={value!r})"
                )
        # PoolDeviceError naming what is missing, before anything is made
        if self.pool_device is not None:
            # torch: only for a pool on a device
            from kv_connector.reader.pool.memory import device_of

            device_of(self.pool_device)


Options = TypeVar("Options", bound=ClientOptions)


def options_of(kind: type[Options], given: Options | None, keywords: Mapping[str, Any]) -> Options:
    """``given``, or a ``kind`` built of ``keywords``.

    A client takes its record or its fields as keywords; ``TypeError`` says so when it is
    handed both."""
    if given is None:
        return kind.of(**keywords)
    if keywords:
        raise TypeError(f"pass a {kind.__name__} or its fields as keywords, not both: {sorted(keywords)}")
    return given


__all__ = [
    "AGENT_POOL_BYTES",
    "DEFAULT_POOL_BYTES",
    "BoundSocket",
    "ClientOptions",
    "PositiveInt",
    "PositiveSeconds",
    "options_of",
]
