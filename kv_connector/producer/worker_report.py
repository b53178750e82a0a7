"""What the workers tell the scheduler side each step, as a typed record shared by the
connector, the worker side, the scheduler side and the delivery book. Pure logic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kv_connector.wire.failure import SampleFailure


class LinkChange(NamedTuple):
    """A rank's link to a reader changed: ``error`` None means it is connected."""

    reader: str  # the reader's address
    rank: int
    error: str | None


@dataclass
class WorkerReport:
    """One step of one worker (or several, merged): link changes, and the requests
    delivered or failed (with the reason) since the last step; in pull delivery, the
    address of each rank's pull endpoint once it listens (rank -> ``HOST:PORT``)."""

    links: list[LinkChange] = field(default_factory=list)
    failures: dict[str, SampleFailure] = field(default_factory=dict)
    delivered: set[str] = field(default_factory=set)
    endpoints: dict[int, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.links or self.failures or self.delivered or self.endpoints)

    def merged(self, other: WorkerReport) -> WorkerReport:
        """Both reports in one (vLLM aggregates the ranks' reports this way); a request
        failed on any rank is failed."""
        return WorkerReport(
            links=self.links + other.links,
            failures={**other.failures, **self.failures},
            delivered=self.delivered | other.delivered,
            endpoints={**other.endpoints, **self.endpoints},
        )
