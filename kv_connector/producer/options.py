"""The connector's options, read from ``kv_connector_extra_config`` and validated once.

Pure logic: a bad value raises ``ConfigurationError`` (a ``ValueError``) naming the key and
the fix, so vLLM fails at startup with that message.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec

from kv_connector.common.errors import ConfigurationError
from kv_connector.sender.config import CREDITS_AHEAD
from kv_connector.wire import block_digest
from kv_connector.wire.control import parse_address
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.protocol import MAX_CREDITS_AHEAD, ShareChecksum

EXAMPLE = (
    '--kv-transfer-config \'{"kv_connector":"HiddenStatesConnector",'
    '"kv_connector_module_path":"kv_connector.connector","kv_role":"kv_producer",'
    '"kv_connector_extra_config":{"consumer_address":"HOST:PORT"}}\''
)


class Sharding(str, enum.Enum):
    """How a request picks its reader among several."""

    # crc32 of the request id, stable across restarts
    REQUEST_HASH = "request_hash"
    # in the order requests start, skipping unreachable readers
    ROUND_ROBIN = "round_robin"


class ChecksumOption(str, enum.Enum):
    """The ``checksum`` option as a user writes it, resolved per rank into one ``ShareChecksum`` or None."""

    # FINGERPRINT where rows are whole 8-byte words; else XXH3 (a GPU share staged to host)
    AUTO = "auto"
    # a few words of every token slot, taken in the step that wrote it
    FINGERPRINT = "fingerprint"
    # diagnostic: each rank sends the XXH3-64 of its share's bytes; the reader checks it
    XXH3 = "xxh3"
    # diagnostic: the XXH3-64 of per-block digests computed where the cache is
    BLOCKS = "blocks"
    NONE = "none"

    def resolve(self, device_cache: bool, layout: BlockLayout) -> ShareChecksum | None:
        """How a rank whose cache has ``layout`` checksums its shares; None means it sends none.

        By default that is fingerprints where a layer's row is whole 8-byte words, else XXH3 of the
        bytes, staged to host memory from a GPU. ValueError when the record asked for cannot read
        those rows.
        """
        whole_words = block_digest.supported(layout)
        if self is ChecksumOption.NONE:
            return None
        if self in (ChecksumOption.BLOCKS, ChecksumOption.FINGERPRINT) and not whole_words:
            raise ConfigurationError(
                f"{self.value} checksums need rows of whole 8-byte words; {layout.hidden_size} x "
                f'{layout.dtype} is not (use "checksum": "xxh3")'
            )
        if self is ChecksumOption.BLOCKS:
            return ShareChecksum.BLOCKS
        if self is ChecksumOption.FINGERPRINT or (self is ChecksumOption.AUTO and whole_words):
            return ShareChecksum.FINGERPRINT
        return ShareChecksum.XXH3


def captured_layer_order(configured: Sequence[int]) -> list[int]:
    """The layer ids in the order vLLM stacks their states: ``hidden_states[:, i]`` is layer ``[i]`` here.

    vLLM 0.32 stores ``tuple(sorted(set(ids)))`` in ``EagleModelMixin._set_aux_hidden_state_layers``.
    Each model's forward appends a layer's state as its pass reaches that layer, so states come
    in increasing layer id. A KV connector never sees the model object, only its config, so this
    derives the order as vLLM does, here and nowhere else in the package.

    Raises ValueError naming a duplicate id. vLLM captures each layer once but gives each listed
    id a cache slot, and then fails at its first step.
    """
    seen: set[int] = set()
    for k in configured:
        if k in seen:
            raise ConfigurationError(
                f"eagle_aux_hidden_state_layer_ids lists layer {k} more than once ({list(configured)}): "
                "vLLM captures each layer once but sizes its hidden-state cache by the list, and "
                f"fails at the first step; list each layer once, e.g. {sorted(set(configured))}"
            )
        seen.add(k)
    return sorted(configured)


class Delivery(str, enum.Enum):
    """How samples reach their consumer."""

    # each rank WRITEs a finished sample into a reader's pool, under its credits
    PUSH = "push"
    # each rank holds it in vLLM's cache until a consumer READs and releases it
    PULL = "pull"


SHARDING = tuple(s.value for s in Sharding)
CHECKSUMS = tuple(c.value for c in ChecksumOption)
DELIVERIES = tuple(d.value for d in Delivery)
PULL_TIMEOUT_S = 300.0

# a timeout: a positive number of seconds (a year at most: infinity is no deadline)
Seconds = Annotated[float, msgspec.Meta(gt=0, le=365 * 86400)]
ProducerId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class PushOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Push delivery's options (``ConnectorOptions`` says what each one means)."""

    # consumer_address; empty in pull delivery
    readers: tuple[str, ...] = ()
    sharding: Sharding = Sharding.REQUEST_HASH
    sample_timeout_s: Seconds = 300.0
    preempt_timeout_s: Seconds = 5.0
    credits_ahead: Annotated[int, msgspec.Meta(ge=0, le=MAX_CREDITS_AHEAD)] = CREDITS_AHEAD

    def __post_init__(self) -> None:
        for a in self.readers:
            try:
                parse_address(a)
            except ValueError as e:
                raise ConfigurationError(f"kv_connector_extra_config.consumer_address: {e}") from None
        if len(set(self.readers)) != len(self.readers):
            raise ConfigurationError("kv_connector_extra_config.consumer_address lists a reader twice")


class PullServing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Pull delivery's options at the producer: where its ranks serve and how long they hold a
    sample (``ConnectorOptions`` says what each one means). The consumer's are the pull client's
    ``PullOptions``."""

    # pull_listen
    listen: Annotated[str, msgspec.Meta(min_length=1)] = "127.0.0.1"
    # pull_timeout_s
    timeout_s: Seconds = PULL_TIMEOUT_S


# each section's flat keys in kv_connector_extra_config, by field
_SECTIONS: dict[str, dict[str, str]] = {
    "push": {
        "consumer_address": "readers",
        "sharding": "sharding",
        "sample_timeout_s": "sample_timeout_s",
        "preempt_timeout_s": "preempt_timeout_s",
        "credits_ahead": "credits_ahead",
    },
    "pull": {"pull_listen": "listen", "pull_timeout_s": "timeout_s"},
}


class ConnectorOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The connector's options, decoded from ``kv_connector_extra_config`` by ``parse``.

    Both modes read the common fields; each mode reads its own section (``push``, ``pull``).
    The sections' fields are flat keys in the config: ``consumer_address`` is ``push.readers``,
    ``pull_listen`` and ``pull_timeout_s`` are ``pull.listen`` and ``pull.timeout_s``.

    readers: the readers' control addresses (``consumer_address``). One ``HOST:PORT``, or a list
    that shards the samples over several readers, each sample to exactly one.
    sharding: how a request picks its reader. "request_hash" (crc32 of the request id) is the
    default; "round_robin" goes in the order requests complete.
    producer_id: this engine's name at the reader (default: vLLM's engine_id). A
    data-parallel replica adds ``-dp{n}`` to a name given here (``producer_id_for``).
    connect_timeout_s: how long a worker keeps trying to reach the reader.
    drain_timeout_s: at shutdown, how long to wait for samples still in flight.
    include_output_tokens: ship output tokens too, for every request. A single request can ask
    with ``kv_transfer_params={"include_output_tokens": true}``.
    checksum: the integrity record each rank sends with its share, checked where it landed.
    "auto" (default) is "fingerprint" where a layer's row is whole 8-byte words, else "xxh3".
    "fingerprint" is XXH3-64 over a few words of every token slot, taken in the step that wrote
    the slot (``wire.fingerprint``). It catches slots read from the wrong blocks and blocks
    changed after they were written, for about 0.1% of the bytes. Two diagnostic modes hash every
    byte at both ends: "xxh3" over the share's bytes, "blocks" over per-block digests computed
    where the cache is (``block_digest``). "none" skips the record.
    sample_timeout_s: a sample granted pages and not acknowledged this long after fails, and the
    reader drops it (default 300).
    preempt_timeout_s: how long a preempted request's share may hold the engine step to be
    written before its sample fails (default 5).
    credits_ahead: runs of pages an engine of one rank (no tensor parallelism) asks each reader
    to grant ahead of its samples, so that each sample's WRITE goes out without a credit round
    trip; 0 asks for none (default 2; 0 to 8). TP ranks always ask per sample.
    delivery: "push" (default) WRITEs each sample into a reader's pool. "pull" holds a finished
    sample's blocks on each rank and serves them to a consumer with its handle
    (``reader.pull.client``); pull takes no consumer_address.
    pull_listen: where each rank's pull endpoint listens, ``HOST`` or ``HOST:PORT``. The port is
    rank 0's and rank r takes PORT + r; the default is 127.0.0.1 on a free port.
    pull_timeout_s: a pulled sample not released this long after its request finished is freed
    and logged by name; fetching it then fails "expired" (default 300).
    check_tokens: compare each shipped sample's token ids with the input ids its positions were
    computed from; a mismatch fails the sample by name. Default true.
    """

    producer_id: ProducerId | None = None
    connect_timeout_s: Seconds = 60.0
    drain_timeout_s: Seconds = 60.0
    include_output_tokens: bool = False
    checksum: ChecksumOption = ChecksumOption.AUTO
    delivery: Delivery = Delivery.PUSH
    check_tokens: bool = True
    push: PushOptions = msgspec.field(default_factory=PushOptions)
    pull: PullServing = msgspec.field(default_factory=PullServing)

    def __post_init__(self) -> None:
        if self.delivery is Delivery.PULL:
            if self.push.readers:
                raise ConfigurationError(
                    'kv_connector_extra_config.consumer_address is for "delivery": "push"; pull delivery has '
                    "no reader (consumers fetch each sample by its handle)"
                )
            try:
                pull_endpoint(self.pull.listen, 0)
            except ValueError as e:
                raise ConfigurationError(f"kv_connector_extra_config.pull_listen: {e}") from None
        elif not self.push.readers:
            raise ConfigurationError(_HINTS["consumer_address"])

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """The options ``kv_connector_extra_config`` gives, or a ValueError naming the key and the fix.

        vLLM prints that message when it fails at startup.
        """
        raw = dict(extra or {})
        sectioned = {k for keys in _SECTIONS.values() for k in keys}
        known = {f for f in cls.__struct_fields__ if f not in _SECTIONS} | sectioned
        unknown = set(raw) - known
        if unknown:
            raise ConfigurationError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(known)}"
            )
        if raw.get("delivery", Delivery.PUSH.value) not in DELIVERIES:
            raise ConfigurationError(
                f"kv_connector_extra_config.delivery {_HINTS['delivery']}, got {raw['delivery']!r}"
            )
        if raw.get("delivery") == Delivery.PULL.value:
            for key in ("consumer_address", "sharding"):
                if key in raw:
                    raise ConfigurationError(
                        f'kv_connector_extra_config.{key} is for "delivery": "push"; pull delivery has '
                        "no reader (consumers fetch each sample by its handle)"
                    )
        elif "consumer_address" in raw:
            addr = raw["consumer_address"]
            addrs = [addr] if isinstance(addr, str) else addr
            if not isinstance(addrs, list) or not addrs or not all(isinstance(a, str) and a for a in addrs):
                raise ConfigurationError(_HINTS["consumer_address"])
            raw["consumer_address"] = addrs
        else:
            raise ConfigurationError(_HINTS["consumer_address"])
        nested: dict[str, Any] = {k: v for k, v in raw.items() if k not in sectioned}
        for section, keys in _SECTIONS.items():
            nested[section] = {field: raw[key] for key, field in keys.items() if key in raw}
        try:
            return msgspec.convert(nested, cls)
        except msgspec.ValidationError as e:
            key = _key_of(str(e))
            if key in _HINTS:
                raise ConfigurationError(f"kv_connector_extra_config.{key} {_HINTS[key]} ({e})") from None
            # __post_init__'s own message, which names the key
            raise ConfigurationError(str(e)) from None


_SECONDS = "must be a positive number of seconds"
_HINTS = {
    "consumer_address": (
        "HiddenStatesConnector needs kv_connector_extra_config.consumer_address, the "
        "reader's HOST:PORT or a list of them (start `python -m kv_connector.reader`), "
        f"e.g. {EXAMPLE}"
    ),
    "sharding": f"must be one of {SHARDING}",
    "producer_id": "must be a non-empty string of at most 128 characters",
    "connect_timeout_s": _SECONDS,
    "drain_timeout_s": _SECONDS,
    "sample_timeout_s": _SECONDS,
    "preempt_timeout_s": _SECONDS,
    "credits_ahead": f"must be a whole number from 0 to {MAX_CREDITS_AHEAD}",
    "include_output_tokens": "must be true or false",
    "check_tokens": "must be true or false",
    "checksum": f"must be one of {CHECKSUMS}",
    "delivery": f"must be one of {DELIVERIES}",
    "pull_listen": "must be HOST or HOST:PORT",
    "pull_timeout_s": _SECONDS,
}


# the suffix vLLM gives each data-parallel replica's kv_transfer_config.engine_id
_REPLICA = re.compile(r"_dp(\d+)$")


def replica_of(engine_id: str) -> int | None:
    """The data-parallel replica an engine id names, or None where vLLM runs no replicas.

    vLLM's engine core appends ``_dp{n}`` to every replica's ``engine_id``, replica 0's
    included. The config's ``data_parallel_size`` says nothing here, since vLLM runs each
    replica of a dense model as an engine of its own with a size of 1."""
    found = _REPLICA.search(engine_id)
    return int(found.group(1)) if found else None


def producer_id_for(given: str | None, engine_id: str) -> str:
    """This engine's name at the reader: ``vllm-{engine_id}``, or the ``producer_id`` option.

    Each data-parallel replica is a producer of its own, with its own ranks, credits and
    samples. vLLM's engine id names the replica already; a given name gets ``-dp{n}``."""
    if given is None:
        return f"vllm-{engine_id}"
    replica = replica_of(engine_id)
    return given if replica is None else f"{given}-dp{replica}"


def pull_endpoint(listen: str, rank: int) -> tuple[str, int]:
    """The (host, port) rank ``rank``'s pull endpoint binds for ``pull_listen``; port 0 takes any free one.

    ``rank`` counts across data-parallel replicas on one host (``replica * world + rank``),
    so a fixed port gives each replica's ranks ports of their own."""
    if listen.count(":") == 1 or "]:" in listen:
        host, port = parse_address(listen)
    else:
        host, port = listen.strip("[]"), 0
    if not host:
        raise ConfigurationError(f"{listen!r} names no host")
    return host, (port + rank if port else 0)


def _key_of(error: str) -> str:
    """The flat option a msgspec error is about.

    Its path ends "- at `$.key`", or "- at `$.section.field`" for a mode's own option.
    """
    _, _, path = error.rpartition("at `$.")
    parts = path.split("`")[0].split("[")[0].split(".")
    if len(parts) > 1 and parts[0] in _SECTIONS:
        flat = {field: key for key, field in _SECTIONS[parts[0]].items()}
        return flat.get(parts[1], parts[1])
    return parts[0]
