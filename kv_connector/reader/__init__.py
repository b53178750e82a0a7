"""The consumer side: ``HiddenStatesReader`` yields ``Sample``s received from producers;
``HiddenStatesDataset`` wraps it for torch; ``python -m kv_connector.reader`` writes files."""

from kv_connector.reader.dataset import HiddenStatesDataset
from kv_connector.reader.lease import Sample, SampleReleased
from kv_connector.reader.reader import HiddenStatesReader, LeaseLimitError, ReaderClosed

__all__ = [
    "HiddenStatesDataset",
    "HiddenStatesReader",
    "LeaseLimitError",
    "ReaderClosed",
    "Sample",
    "SampleReleased",
]
