"""The consumer library, its public face: ``HiddenStatesReader`` (configured by a
``ReaderConfig``) yields ``Sample``s received from producers; ``HiddenStatesDataset``
wraps it for torch. ``python -m kv_connector.reader`` runs the file CLI
(``kv_connector.files``), which uses only what is exported here."""

from kv_connector.reader.dataset import HiddenStatesDataset
from kv_connector.reader.lease import Sample, SampleReleased
from kv_connector.reader.ledger import SAMPLE_TIMEOUT_S
from kv_connector.reader.metrics_server import MetricsAddressError
from kv_connector.reader.pool_memory import PoolDeviceError
from kv_connector.reader.reader import (
    HiddenStatesReader,
    LeaseLimitError,
    ReaderClosed,
    ReaderConfig,
    refuse_open_listen,
)
from kv_connector.reader.records import AckMode, RequireChecksum
from kv_connector.reader.stats import PoolState, ProducerTotals, ReaderStats
from kv_connector.reader.values import find_bad_values
from kv_connector.wire.provenance import Expectation, ModelRunner, Provenance

__all__ = [
    "SAMPLE_TIMEOUT_S",
    "AckMode",
    "Expectation",
    "HiddenStatesDataset",
    "HiddenStatesReader",
    "LeaseLimitError",
    "MetricsAddressError",
    "ModelRunner",
    "PoolDeviceError",
    "PoolState",
    "ProducerTotals",
    "Provenance",
    "ReaderClosed",
    "ReaderConfig",
    "ReaderStats",
    "RequireChecksum",
    "Sample",
    "SampleReleased",
    "find_bad_values",
    "refuse_open_listen",
]
