"""What the workers tell the scheduler side each step, as a typed record shared by the
connector, the worker side, the scheduler side and the delivery book. Pure logic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kv_connector.wire.failure import SampleFailure


class LinkChange(NamedTuple):
    """A rank's link to a reader changed: ``error`` None means it is connected."""

    # the reader's address
    reader: str
    rank: int
    error: str | None


@dataclass
class WorkerReport:
    """One step of one worker (or several, merged): link changes, and the requests
    delivered or failed (with the reason) since the last step. ``news``: what the workers'
    delivery mode tells its scheduler part, in records of the mode's own, carried unread
    (pull: where each rank serves, once it listens)."""

    links: list[LinkChange] = field(default_factory=list)
    failures: dict[str, SampleFailure] = field(default_factory=dict)
    delivered: set[str] = field(default_factory=set)
    news: list[object] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.links or self.failures or self.delivered or self.news)

    def merged(self, other: WorkerReport) -> WorkerReport:
        """Both reports in one (vLLM aggregates the ranks' reports this way); a request
        failed on any rank is failed."""
        return WorkerReport(
            links=self.links + other.links,
            failures={**other.failures, **self.failures},
            delivered=self.delivered | other.delivered,
            news=self.news + other.news,
        )
