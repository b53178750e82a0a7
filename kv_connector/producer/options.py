"""The connector's options, read from ``kv_connector_extra_config`` and validated once.

Pure logic: a bad value raises ``ValueError`` naming the key and the fix, so vLLM fails
at startup with that message.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_connector.wire.control import parse_address

EXAMPLE = (
    '--kv-transfer-config \'{"kv_connector":"HiddenStatesConnector",'
    '"kv_connector_module_path":"kv_connector.connector","kv_role":"kv_producer",'
    '"kv_connector_extra_config":{"consumer_address":"HOST:PORT"}}\''
)


class Sharding(str, enum.Enum):
    """How a request picks its reader among several."""

    REQUEST_HASH = "request_hash"  # crc32 of the request id, stable across restarts
    ROUND_ROBIN = "round_robin"  # in the order requests start, skipping unreachable readers


class Checksum(str, enum.Enum):
    AUTO = "auto"  # XXH3 for a cache in host memory, BLOCKS for one on a GPU
    XXH3 = "xxh3"  # each rank sends the XXH3-64 of its share's bytes; the reader checks it
    BLOCKS = "blocks"  # the XXH3-64 of per-block digests computed where the cache is
    NONE = "none"

    def block_digests(self, device_cache: bool, whole_words: bool) -> bool:
        """Whether a rank sends block digests: asked for, or by default where its cache
        is on a GPU and its rows are whole 8-byte words (``block_digest.supported``;
        otherwise the share is staged and hashed as bytes)."""
        return self is Checksum.BLOCKS or (self is Checksum.AUTO and device_cache and whole_words)


class Delivery(str, enum.Enum):
    """How samples reach their consumer."""

    PUSH = "push"  # each rank WRITEs a finished sample into a reader's pool, under its credits
    PULL = "pull"  # each rank holds it in vLLM's cache until a consumer READs and releases it


SHARDING = tuple(s.value for s in Sharding)
DELIVERIES = tuple(d.value for d in Delivery)
PULL_TIMEOUT_S = 300.0
CHECKSUMS = tuple(c.value for c in Checksum)

_KNOWN = {
    "consumer_address",
    "sharding",
    "producer_id",
    "connect_timeout_s",
    "drain_timeout_s",
    "include_output_tokens",
    "checksum",
    "sample_timeout_s",
    "preempt_timeout_s",
    "delivery",
    "pull_listen",
    "pull_timeout_s",
}


@dataclass(frozen=True)
class ConnectorOptions:
    """consumer_address: the reader's control address (required); a list of addresses
    shards the samples over several readers, each sample to exactly one.
    sharding: how a request picks its reader: "request_hash" (crc32 of the request id,
    the default) or "round_robin" (in the order requests complete).
    producer_id: this engine's name at the reader (default: vLLM's engine_id).
    connect_timeout_s: how long a worker keeps trying to reach the reader.
    drain_timeout_s: at shutdown, how long to wait for samples still in flight.
    include_output_tokens: ship output tokens too, for every request (a request can
    also ask with ``kv_transfer_params={"include_output_tokens": true}``).
    checksum: each rank sends a checksum of its share after its WRITE and the reader checks
    it. "auto" (default): "xxh3" for a cache in host memory, "blocks" for one on a GPU;
    "xxh3": XXH3-64 of the share's bytes (a GPU cache's share is staged to host memory
    once for it); "blocks": XXH3-64 of per-block digests computed with torch where the
    cache is (``block_digest``; 8 bytes per block reach the host, the reader recomputes
    them on CPU); "none" skips it.
    sample_timeout_s: a sample granted pages at the reader and not acknowledged this long
    after fails, and the reader drops it (default 300).
    preempt_timeout_s: how long a preempted request's share may hold the engine step to be
    written (it may wait for the reader's credits) before its sample fails (default 5).
    delivery: "push" (default: the ranks WRITE each sample into a reader's pool) or "pull"
    (no reader: each rank holds a finished sample's blocks and serves it to a consumer
    holding its handle, ``reader.pull``); pull needs no consumer_address.
    pull_listen: where each rank's pull endpoint listens, ``HOST`` or ``HOST:PORT`` (the
    port is rank 0's; rank r takes PORT + r); default 127.0.0.1 on a free port.
    pull_timeout_s: a pulled sample not released this long after it was computed is freed
    and logged by name; fetching it then fails "expired" (default 300).
    """

    consumer_address: str
    producer_id: str | None = None
    consumer_addresses: tuple[str, ...] = ()
    sharding: Sharding = Sharding.REQUEST_HASH
    connect_timeout_s: float = 60.0
    drain_timeout_s: float = 60.0
    include_output_tokens: bool = False
    checksum: Checksum = Checksum.AUTO
    sample_timeout_s: float = 300.0
    preempt_timeout_s: float = 5.0
    delivery: Delivery = Delivery.PUSH
    pull_listen: str = "127.0.0.1"
    pull_timeout_s: float = PULL_TIMEOUT_S

    @property
    def pull(self) -> bool:
        return self.delivery is Delivery.PULL

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        extra = dict(extra or {})
        unknown = set(extra) - _KNOWN
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(_KNOWN)}"
            )
        delivery = extra.get("delivery", "push")
        if delivery not in DELIVERIES:
            raise ValueError(
                f"kv_connector_extra_config.delivery must be one of {DELIVERIES}, got {delivery!r}"
            )
        if delivery == "pull":
            return cls._parse_pull(extra)
        addr = extra.get("consumer_address")
        addrs = [addr] if isinstance(addr, str) else addr
        if not isinstance(addrs, list) or not addrs or not all(isinstance(a, str) and a for a in addrs):
            raise ValueError(
                "HiddenStatesConnector needs kv_connector_extra_config.consumer_address, the "
                "reader's HOST:PORT or a list of them (start `python -m kv_connector.reader`), "
                f"e.g. {EXAMPLE}"
            )
        for a in addrs:
            try:
                parse_address(a)
            except ValueError as e:
                raise ValueError(f"kv_connector_extra_config.consumer_address: {e}") from None
        if len(set(addrs)) != len(addrs):
            raise ValueError("kv_connector_extra_config.consumer_address lists a reader twice")
        sharding = extra.get("sharding", "request_hash")
        if sharding not in SHARDING:
            raise ValueError(
                f"kv_connector_extra_config.sharding must be one of {SHARDING}, got {sharding!r}"
            )
        return cls(
            consumer_address=addrs[0],
            consumer_addresses=tuple(addrs),
            sharding=Sharding(sharding),
            **_common(extra),
        )

    @classmethod
    def _parse_pull(cls, extra: Mapping[str, Any]) -> ConnectorOptions:
        for key in ("consumer_address", "sharding"):
            if key in extra:
                raise ValueError(
                    f'kv_connector_extra_config.{key} is for "delivery": "push"; pull delivery has '
                    "no reader (consumers fetch each sample by its handle)"
                )
        common = _common(extra)
        if common["include_output_tokens"]:
            raise ValueError('include_output_tokens is not supported with "delivery": "pull" yet')
        listen = extra.get("pull_listen", "127.0.0.1")
        if not isinstance(listen, str) or not listen:
            raise ValueError("kv_connector_extra_config.pull_listen must be HOST or HOST:PORT")
        try:
            pull_endpoint(listen, 0)
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config.pull_listen: {e}") from None
        return cls(
            consumer_address="",
            delivery=Delivery.PULL,
            pull_listen=listen,
            pull_timeout_s=_seconds(extra, "pull_timeout_s", PULL_TIMEOUT_S),
            **common,
        )

    @property
    def readers(self) -> tuple[str, ...]:
        """The readers' addresses (push); in pull mode one stand-in, the ranks' endpoints
        (the delivery book admits requests once every rank's endpoint is up)."""
        if self.pull:
            return (PULL_ENDPOINTS,)
        return self.consumer_addresses or (self.consumer_address,)


PULL_ENDPOINTS = "the ranks' pull endpoints"


def pull_endpoint(listen: str, rank: int) -> tuple[str, int]:
    """(host, port) rank ``rank``'s pull endpoint binds for ``pull_listen`` (port 0: any
    free one)."""
    if listen.count(":") == 1 or "]:" in listen:
        host, port = parse_address(listen)
    else:
        host, port = listen.strip("[]"), 0
    if not host:
        raise ValueError(f"{listen!r} names no host")
    return host, (port + rank if port else 0)


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"kv_connector_extra_config.{key} must be a positive number of seconds")
    return float(v)


def _common(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The options both deliveries take, validated."""
    pid = extra.get("producer_id")
    if pid is not None and (not isinstance(pid, str) or not 0 < len(pid) <= 128):
        raise ValueError("kv_connector_extra_config.producer_id must be a non-empty string")
    inc = extra.get("include_output_tokens", False)
    if not isinstance(inc, bool):
        raise ValueError("kv_connector_extra_config.include_output_tokens must be true or false")
    checksum = extra.get("checksum", "auto")
    if checksum not in CHECKSUMS:
        raise ValueError(f"kv_connector_extra_config.checksum must be one of {CHECKSUMS}, got {checksum!r}")
    return {
        "checksum": Checksum(checksum),
        "producer_id": pid,
        "connect_timeout_s": _seconds(extra, "connect_timeout_s", 60.0),
        "drain_timeout_s": _seconds(extra, "drain_timeout_s", 60.0),
        "include_output_tokens": inc,
        "sample_timeout_s": _seconds(extra, "sample_timeout_s", 300.0),
        "preempt_timeout_s": _seconds(extra, "preempt_timeout_s", 5.0),
    }
