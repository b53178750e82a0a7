"""A torch ``IterableDataset`` over a ``HiddenStatesReader``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from kv_connector.reader.pool.lease import Sample
from kv_connector.reader.push.reader import HiddenStatesReader


class HiddenStatesDataset(IterableDataset[Sample]):
    """Streams ``Sample``s from a reader that lives in this process.

    Use it with ``DataLoader(ds, batch_size=None, num_workers=0)``: the reader owns a NIXL
    agent and its pool, which do not cross into worker processes. ``max_samples`` ends
    the iteration after that many samples; ``timeout`` (seconds) bounds each wait.
    """

    def __init__(
        self,
        reader: HiddenStatesReader | None = None,
        max_samples: int | None = None,
        timeout: float | None = None,
        **reader_kwargs: Any,
    ) -> None:
        super().__init__()
        self.reader = reader if reader is not None else HiddenStatesReader(**reader_kwargs)
        self.max_samples = max_samples
        self.timeout = timeout

    def __iter__(self) -> Iterator[Sample]:
        return self.reader.samples(self.max_samples, self.timeout)

    def close(self) -> None:
        self.reader.close()
