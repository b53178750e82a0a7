"""The UCX settings an agent gets and the reading of UCX's descriptions of its choices:
our defaults never over a user's value and off by one switch; report files named as UCX
1.23 names them (the host ones copied from a CPU run, the GPU ones in the same form as the
tables an H200 printed) read into pairings and transports; tcp under a GPU buffer warned
with the setting that avoids it."""

from __future__ import annotations

import pytest

from kv_connector.wire.ucx_report import (
    PUT_GET_ONLY,
    Kind,
    Mem,
    Op,
    Pairing,
    Reach,
    advice,
    any_rdma,
    bulk,
    choice_of,
    engine_config,
    kind_of,
    parse_engine_config,
    sanitized,
    table_transports,
)

OURS = {"CUDA_IPC_ENABLE_GET_ZCOPY": "y", "RMA_PPLN_ENABLE": "y"}


def dot(config: str) -> str:
    return f'digraph {{\n\tnode0 [label="zero-copy\\n{config}" shape=box style=rounded]\n}}\n'


def test_our_defaults_go_to_an_agent_that_nobody_configured() -> None:
    text, applied = engine_config({})
    assert parse_engine_config(text) == OURS
    assert [s.key for s in applied] == list(OURS)


def test_a_users_value_wins_in_the_environment_or_in_the_agents_own_config() -> None:
    text, applied = engine_config({"UCX_RMA_PPLN_ENABLE": "n"}, "CUDA_IPC_ENABLE_GET_ZCOPY=n,TLS=tcp")
    assert parse_engine_config(text) == {"CUDA_IPC_ENABLE_GET_ZCOPY": "n", "TLS": "tcp"}
    assert applied == []


@pytest.mark.parametrize("off", ["0", "n", "false", "OFF"])
def test_one_switch_turns_our_defaults_off(off: str) -> None:
    assert engine_config({"KV_CONNECTOR_UCX_DEFAULTS": off}) == ("", [])


def test_the_report_asks_for_files_of_writes_and_reads_only() -> None:
    text, _ = engine_config({"KV_CONNECTOR_UCX_DEFAULTS": "0"}, report_dir="/tmp/kvc-ucx-x")
    assert parse_engine_config(text) == {"PROTO_INFO_DIR": "/tmp/kvc-ucx-x", "PROTO_INFO": PUT_GET_ONLY}
    # the user's own UCX_PROTO_INFO wins; at UCX's debug level its "auto" describes everything
    for env in ({"UCX_PROTO_INFO": "y"}, {"UCX_LOG_LEVEL": "debug"}):
        text, _ = engine_config({"KV_CONNECTOR_UCX_DEFAULTS": "0", **env}, report_dir="/d")
        assert parse_engine_config(text) == {"PROTO_INFO_DIR": "/d"}


def test_the_glob_takes_short_names_of_puts_and_gets_and_no_long_name_ucx_prints() -> None:
    from fnmatch import fnmatchcase

    for short in ("put(multi) from cuda/GPU0 to host", "get(multi) into host memory from cuda/dev[1]"):
        assert fnmatchcase(short, PUT_GET_ONLY)
    for other in ("am_send from host memory", "remote memory write by ucp_put* from host memory to host"):
        assert not fnmatchcase(other, PUT_GET_ONLY)


def test_names_are_cut_and_sanitized_as_ucx_writes_them() -> None:
    assert sanitized("agent-a.x") == "agent_a_x"
    assert sanitized("dev[1]") == "dev_1"
    assert sanitized("p" * 40) == "p" * 31


@pytest.mark.parametrize(
    ("name", "pairing", "first", "last"),
    [
        (  # a CPU run's (NIXL 1.5.1, UCX 1.23.0)
            "agent_a_x_intra_node_cfg_1_put_multi_from_host_memory_to_host_8173_inf.dot",
            Pairing(Op.WRITE, Mem.HOST, Mem.HOST, Reach.SAME_NODE),
            8173,
            None,
        ),
        (
            "agent_a_x_intra_node_cfg_1_get_multi_into_host_memory_from_host_627_5843.dot",
            Pairing(Op.READ, Mem.HOST, Mem.HOST, Reach.SAME_NODE),
            627,
            5843,
        ),
        (
            "agent_a_x_intra_node_cfg_2_get_multi_into_cuda_GPU0_from_cuda_dev_1_0_inf.dot",
            Pairing(Op.READ, Mem.GPU, Mem.GPU, Reach.SAME_NODE),
            0,
            None,
        ),
        (
            "agent_a_x_inter_node_cfg_3_put_fast_completion_multi_from_cuda_GPU0_to_host_1_inf.dot",
            Pairing(Op.WRITE, Mem.GPU, Mem.HOST, Reach.OTHER_NODE),
            1,
            None,
        ),
        (
            "agent_a_x_self_cfg_0_put_from_host_memory_to_cuda_0_0.dot",
            Pairing(Op.WRITE, Mem.HOST, Mem.GPU, Reach.SELF),
            0,
            0,
        ),
    ],
)
def test_a_report_file_names_its_pairing_and_range(
    name: str, pairing: Pairing, first: int, last: int | None
) -> None:
    c = choice_of(name, dot("50% on cuda_ipc/cuda and 50% on cma/memory"), "agent-a.x")
    assert c is not None
    assert (c.pairing, c.first, c.last) == (pairing, first, last)
    assert c.transports == ("cma/memory", "cuda_ipc/cuda")


def test_files_of_other_agents_and_other_operations_are_not_ours() -> None:
    text = dot("tcp/lo")
    assert (
        choice_of("agent_b_intra_node_cfg_1_put_from_host_memory_to_host_0_inf.dot", text, "agent-a") is None
    )
    assert choice_of("agent_a_intra_node_cfg_1_am_send_from_host_memory_0_inf.dot", text, "agent-a") is None
    assert choice_of("agent_a_intra_node_cfg_1_put_from_host_memory_to_host_0_inf.dot", "", "agent-a") is None


def test_the_bulk_is_the_range_without_end_over_the_variants_of_an_operation() -> None:
    a = "a_intra_node_cfg_1_put"
    choices = [
        choice_of(f"{a}_from_cuda_GPU0_to_host_0_8172.dot", dot("tcp/lo"), "a"),
        choice_of(f"{a}_from_cuda_GPU0_to_host_8173_inf.dot", dot("cma/memory"), "a"),
        choice_of(f"{a}_multi_from_cuda_GPU0_to_host_8173_inf.dot", dot("cuda_ipc/cuda"), "a"),
    ]
    assert bulk(c for c in choices if c is not None) == {
        Pairing(Op.WRITE, Mem.GPU, Mem.HOST, Reach.SAME_NODE): ("cma/memory", "cuda_ipc/cuda")
    }


@pytest.mark.parametrize(
    ("transport", "kind"),
    [
        ("tcp/lo", Kind.TCP),
        ("rc_mlx5/mlx5_0:1", Kind.RDMA),
        ("dc_mlx5/mlx5_1:1", Kind.RDMA),
        ("rc_verbs/mlx5_0:1", Kind.RDMA),
        ("srd/rdmap0s6-rdm", Kind.RDMA),
        ("cuda_ipc/cuda", Kind.CUDA_IPC),
        ("cuda_copy/cuda", Kind.CUDA_COPY),
        ("cma/memory", Kind.SHARED_MEMORY),
        ("sysv/memory", Kind.SHARED_MEMORY),
        ("self/memory", Kind.SELF),
        ("gdr_copy/cuda", Kind.OTHER),
    ],
)
def test_transport_kinds(transport: str, kind: Kind) -> None:
    assert kind_of(transport) is kind


def test_tcp_under_a_gpu_buffer_names_the_setting_that_avoids_it() -> None:
    # as the H200 measured with UCX's own defaults (one GPU, no NVLink, no RDMA NIC)
    pull_gpu = Pairing(Op.READ, Mem.GPU, Mem.GPU, Reach.SAME_NODE)
    fix = advice(pull_gpu, ["tcp/lo"])
    assert fix is not None and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in fix and "push" in fix
    assert "nixl#2208" in fix and "1.5.1" in fix  # the NIXL that sets it itself
    for pairing in (
        Pairing(Op.WRITE, Mem.GPU, Mem.HOST, Reach.SAME_NODE),
        Pairing(Op.READ, Mem.HOST, Mem.GPU, Reach.SAME_NODE),
    ):
        fix = advice(pairing, ["tcp/lo"])
        assert fix is not None and "UCX_RMA_PPLN_ENABLE=y" in fix and "pool_device" in fix
        # a WRITE into another process's host memory has the mapped pool as its faster pairing
        assert ("node_pool=True" in fix) is (pairing.op is Op.WRITE)
    other = advice(Pairing(Op.WRITE, Mem.GPU, Mem.GPU, Reach.OTHER_NODE), ["tcp/eth0"])
    assert other is not None and "RDMA" in other
    # no GPU buffer, or no tcp: nothing to say
    assert advice(Pairing(Op.WRITE, Mem.HOST, Mem.HOST, Reach.OTHER_NODE), ["tcp/eth0"]) is None
    assert advice(pull_gpu, ["cuda_ipc/cuda"]) is None
    assert (
        advice(Pairing(Op.WRITE, Mem.GPU, Mem.HOST, Reach.SAME_NODE), ["cma/memory", "cuda_ipc/cuda"]) is None
    )


# UCX 1.23's protocol tables (UCX_PROTO_INFO=y) as it prints them on a GPU host: one table
# per operation, a row per message-size range, transports in the last column
UCX_TABLES = """\
[1795716516.122069] [h100:2442 :0]   +--------+-------------+-----------------------------------+
[1795716516.122069] [h100:2442 :0]   | gpu-check-raw-init self cfg#0                            |
[1795716516.122069] [h100:2442 :0]   | remote memory write by ucp_put* from cuda memory to host |
[1795716516.122069] [h100:2442 :0]   +--------+-------------+-----------------------------------+
[1795716516.122069] [h100:2442 :0]   | Range  | Description |              Config               |
[1795716516.122069] [h100:2442 :0]   +--------+-------------+-----------------------------------+
[1795716516.122069] [h100:2442 :0]   |  0..8K | copy-in     | cuda_copy/cuda                    |
[1795716516.1] [h100:2442 :0]   | 8K..inf| zero-copy   | 50% on cuda_ipc/cuda and 50% on rc_mlx5/mlx5_0:1 |
[1795716516.122069] [h100:2442 :0]   +--------+-------------+-----------------------------------+
[1795716516.124710] [h100:2442 :0]   +------------+--------------------+---------------+
[1795716516.124710] [h100:2442 :0]   | gpu-check-raw-init self cfg#0                   |
[1795716516.124710] [h100:2442 :0]   | active message by ucp_am_send* from host memory |
[1795716516.124710] [h100:2442 :0]   +------------+--------------------+---------------+
[1795716516.124710] [h100:2442 :0]   |          0 | short              | tcp/lo        |
[1795716516.124710] [h100:2442 :0]   +------------+--------------------+---------------+
[1795716516.125000] [h100:2443 :0]   | remote memory read by ucp_get*(multi) into host memory from cuda |
[1795716516.125000] [h100:2443 :0]   +--------+-------------+-----------------------------------+
[1795716516.125000] [h100:2443 :0]   | 0..inf | zero-copy   | cuda_ipc/cuda                     |
"""


def test_printed_tables_are_read_too() -> None:
    assert table_transports(UCX_TABLES) == {
        "remote memory read by ucp_get*(multi) into host memory from cuda": ["cuda_ipc/cuda"],
        "remote memory write by ucp_put* from cuda memory to host": [
            "cuda_copy/cuda",
            "cuda_ipc/cuda",
            "rc_mlx5/mlx5_0:1",
        ],
    }
    assert table_transports("no tables here\n") == {}


@pytest.mark.parametrize(
    ("transports", "want"),
    [
        (["cuda_ipc/cuda"], False),
        (["cuda_copy/cuda", "cma/memory", "tcp/lo"], False),
        (["cuda_ipc/cuda", "rc_mlx5/mlx5_0:1"], True),  # UCX splits a large READ over both
        (["srd/efa_0"], True),
        (["gdaki/mlx5_0"], True),  # a transport not known here counts as RDMA: flush rather than not
        ([], False),
    ],
)
def test_which_transports_may_have_written_by_rdma(transports: list[str], want: bool) -> None:
    assert any_rdma(transports) is want
