"""The clients' options: ``ReaderConfig`` and ``PullOptions`` extend one ``ClientOptions``,
each validated when built (strings taken for its kinds), and each client takes its record
or its fields as keywords, never both."""

from __future__ import annotations

import pickle
import socket

import msgspec
import pytest

from kv_connector.reader import (
    AGENT_POOL_BYTES,
    DEFAULT_POOL_BYTES,
    AckMode,
    ClientOptions,
    Expectation,
    FetchAgentProcess,
    HiddenStatesReader,
    PullClient,
    PullOptions,
    ReaderConfig,
    RequireChecksum,
)
from kv_connector.reader.agent.wire import AgentConfig


def test_kinds_given_as_strings_become_their_types_and_pages_round_up() -> None:
    c = ReaderConfig.of(ack="manual", require_checksum="never", pool_bytes=1 << 20, page_bytes=100)
    assert c.ack is AckMode.MANUAL and c.require_checksum is RequireChecksum.NEVER
    assert c.page_bytes == 100 and c.page_size == 128  # a multiple of 64
    assert ReaderConfig() == ReaderConfig(ack=AckMode.ON_TAKE) == ReaderConfig.of(ack="on_take")
    # a record built directly holds its types: a string for a kind is refused, naming both ways
    named = r"ReaderConfig.ack takes a AckMode.*ReaderConfig.of\(ack='manual'\)"
    with pytest.raises(ValueError, match=named):
        ReaderConfig(ack="manual")  # type: ignore[arg-type]
    assert PullOptions.of(timeout_s=2.5, copy=True) == PullOptions(timeout_s=2.5, copy=True)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"ack": "later"}, "ack"),
        ({"require_checksum": "sometimes"}, "require_checksum"),
        ({"sample_timeout_s": 0}, "sample_timeout_s"),
        ({"max_leases": 0}, "max_leases"),
        ({"pool_bytes": 0}, "pool_bytes"),
        ({"pool_bytes": 4096, "page_bytes": 8192}, "page_bytes"),
    ],
)
def test_a_bad_value_is_refused_by_name(kw: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ReaderConfig(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=named):
        ReaderConfig.of(**kw)


def test_a_bound_socket_is_taken_as_it_is_for_an_address() -> None:
    with socket.socket() as listen, socket.socket() as metrics:
        c = ReaderConfig(listen=listen, metrics_address=metrics)
        assert c.listen is listen and c.metrics_address is metrics
        assert ReaderConfig.of(listen=listen).listen is listen


def test_the_reader_takes_a_config_or_keywords_not_both() -> None:
    with pytest.raises(TypeError, match="not both"):
        HiddenStatesReader(ReaderConfig(), pool_bytes=1 << 20)
    with pytest.raises(TypeError):
        HiddenStatesReader(pool_megabytes=1)  # not a field


def test_every_client_takes_the_shared_options_each_with_its_pool() -> None:
    reader, pull = ReaderConfig(), PullOptions()
    agent = FetchAgentProcess(check_values=False, name="agent-a")  # not started: no process
    assert isinstance(reader, ClientOptions) and isinstance(pull, ClientOptions)
    assert reader.pool_bytes == pull.pool_bytes == DEFAULT_POOL_BYTES
    assert agent.options.pool_bytes == AGENT_POOL_BYTES and agent.options.shared_pool
    assert agent.options.check_values is False and agent.name == "agent-a"
    for options in (ReaderConfig, PullOptions, FetchAgentProcess):
        with pytest.raises(ValueError, match="pool_bytes"):
            options(pool_bytes=0)


@pytest.mark.parametrize(
    ("kw", "named"), [({"pool_bytes": 100}, "pool_bytes"), ({"timeout_s": 0}, "timeout_s")]
)
def test_a_bad_pull_option_is_refused_by_name(kw: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        PullOptions(**kw)  # type: ignore[arg-type]


def test_a_pull_client_takes_options_or_keywords_not_both_and_pickles_them_whole() -> None:
    with pytest.raises(TypeError, match="not both"):
        PullClient(PullOptions(), copy=True)
    expect = Expectation(layer_ids=[1, 2], dtype="bfloat16")
    client = PullClient(pool_bytes=4 << 20, copy=True, expect=expect, name="c")  # no agent until used
    again = pickle.loads(pickle.dumps(client))
    assert again.options == client.options and again.options.expect == expect and again.name == "c"


def test_the_agents_configuration_line_carries_its_options() -> None:
    options = PullOptions(pool_bytes=4 << 20, expect=Expectation(layer_ids=[3]), shared_pool=True)
    line = msgspec.json.encode(AgentConfig(socket_dir="/nowhere", options=options, spawned_at=1.0))
    assert msgspec.json.decode(line, type=AgentConfig).options == options
