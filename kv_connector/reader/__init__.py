"""The consumer library, its public face: every client and error a user needs.

Push: ``HiddenStatesReader`` (configured by a ``ReaderConfig``) yields ``Sample``s its
producers WRITE into its pool; ``HiddenStatesDataset`` wraps it for torch. Pull:
``PullClient`` (``PullOptions``) READs a sample by its handle; a trainer rank's
``FetchAgentProcess`` holds one for every DataLoader worker, which fetches through an
``AgentClient``. All three share ``ClientOptions``. Every error is a ``KvConnectorError``, under
one of its branches (``kv_connector.common.errors``). ``python -m kv_connector.reader``
runs the file CLI (``kv_connector.files``), which uses only what is exported here."""

from kv_connector.common.errors import (
    ClosedError,
    ConfigurationError,
    IntegrityError,
    KvConnectorError,
    RefusedError,
    StateError,
    WireError,
)
from kv_connector.reader.agent.client import AgentClient, FetchAgentError, FetchAgentProcess
from kv_connector.reader.options import AGENT_POOL_BYTES, DEFAULT_POOL_BYTES, ClientOptions
from kv_connector.reader.pool.lease import Sample, SampleReleased
from kv_connector.reader.pool.memory import PoolDeviceError
from kv_connector.reader.pool.values import find_bad_values
from kv_connector.reader.pull.client import PullClient
from kv_connector.reader.pull.links import FetchError
from kv_connector.reader.pull.options import PullOptions
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
from kv_connector.wire.handle import handle_of
from kv_connector.wire.provenance import Expectation, ModelRunner, Provenance

__all__ = [
    "AGENT_POOL_BYTES",
    "DEFAULT_POOL_BYTES",
    "SAMPLE_TIMEOUT_S",
    "AckMode",
    "AgentClient",
    "ClientOptions",
    "ClosedError",
    "ConfigurationError",
    "Expectation",
    "FetchAgentError",
    "FetchAgentProcess",
    "FetchError",
    "HiddenStatesDataset",
    "HiddenStatesReader",
    "IntegrityError",
    "KvConnectorError",
    "LeaseLimitError",
    "MetricsAddressError",
    "ModelRunner",
    "PoolDeviceError",
    "PoolState",
    "ProducerTotals",
    "Provenance",
    "PullClient",
    "PullOptions",
    "ReaderClosed",
    "ReaderConfig",
    "ReaderStats",
    "RefusedError",
    "RequireChecksum",
    "Sample",
    "SampleReleased",
    "StateError",
    "WireError",
    "find_bad_values",
    "handle_of",
    "refuse_open_listen",
]
