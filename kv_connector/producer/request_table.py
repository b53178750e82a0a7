"""The scheduler side's one record per request: what the planner follows (prompt, block
table, what was computed and shipped) and what the delivery book decides (its reader,
admission, outcome) live in the same ``RequestRecord``, so they cannot drift apart. Pure
logic. A record is made when vLLM adds the request and removed when it finishes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kv_connector.wire.failure import SampleFailure
from kv_connector.wire.identity import NO_IDENTITY, SampleIdentity


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    include_output: bool = False
    # the user's sample id and metadata
    identity: SampleIdentity = NO_IDENTITY
    # --- planning (ShipPlanner)
    # its hidden states are to be shipped
    tracked: bool = True
    prompt: tuple[int, ...] = ()
    block_ids: list[int] = field(default_factory=list)
    # how much of block_ids the workers have (sent in earlier plans)
    sent_blocks: int = 0
    # positions 0..computed-1 have states in the cache
    computed: int = 0
    shipped: bool = False
    # --- delivery (DeliveryBook)
    # the address its sample goes to, decided once by the delivery book
    reader: str | None = None
    admitted: bool = False
    # since when it waits for a reachable reader
    waiting_since: float | None = None
    failed: SampleFailure | None = None
    delivered: bool = False


class RequestTable:
    """The live requests' records, by request id."""

    def __init__(self) -> None:
        self._records: dict[str, RequestRecord] = {}

    def ensure(self, request_id: str) -> RequestRecord:
        """The request's record, made if it has none."""
        rec = self._records.get(request_id)
        if rec is None:
            rec = self._records[request_id] = RequestRecord(request_id)
        return rec

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(list(self._records.values()))

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def remove(self, request_id: str) -> RequestRecord | None:
        return self._records.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)
