"""The consumer side: ``HiddenStatesReader`` yields ``Sample``s received from producers;
``HiddenStatesDataset`` wraps it for torch; ``python -m kv_connector.reader`` writes files."""

from kv_connector.reader.core import HiddenStatesReader, ReaderClosed, Sample
from kv_connector.reader.dataset import HiddenStatesDataset

__all__ = ["HiddenStatesDataset", "HiddenStatesReader", "ReaderClosed", "Sample"]
