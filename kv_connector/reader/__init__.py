"""The consumer library, its public face: ``HiddenStatesReader`` (configured by a
``ReaderConfig``) yields ``Sample``s received from producers; ``HiddenStatesDataset``
wraps it for torch. ``python -m kv_connector.reader`` runs the file CLI
(``kv_connector.files``), which uses only what is exported here."""

from kv_connector.reader.pool.lease import Sample, SampleReleased
from kv_connector.reader.pool.memory import PoolDeviceError
from kv_connector.reader.pool.values import find_bad_values
from kv_connector.reader.push.dataset import HiddenStatesDataset
from kv_connector.reader.push.ledger import SAMPLE_TIMEOUT_S
from kv_connector.reader.push.metrics_server import MetricsAddressError
from kv_connector.reader.push.reader import (
    HiddenStatesReader,
    LeaseLimitError,
    ReaderClosed,
    ReaderConfig,
    refuse_open_listen,
)
from kv_connector.reader.push.records import AckMode, RequireChecksum
from kv_connector.reader.push.stats import PoolState, ProducerTotals, ReaderStats
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
