"""UCX on our transfers: the settings we give it by default, and the transport it picked
for each pairing, read from its own report.

UCX picks a transport per pairing (WRITE or READ, host or GPU memory at each end, this
node or another) when a transfer of that kind is first posted. Two of its defaults send
GPU buffers over ``tcp`` on one node: a READ from another process's GPU where NVML finds
no NVLink (``cuda_ipc`` turns its GET off), and any transfer between a GPU and another
process's host memory (no pipelined protocol unless asked). ``UCX_DEFAULTS`` turns both
on for our agents, never over a user's value. UCX describes each choice it makes in a
file when asked (``PROTO_INFO_DIR``); ``report_config`` asks for files of WRITE and READ
choices only, and ``choice_of`` reads one back. Pure: nothing here imports nixl or reads
a file.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kv_connector.common.errors import ConfigurationError

# "0": leave UCX's own defaults
DEFAULTS_SWITCH = "KV_CONNECTOR_UCX_DEFAULTS"
# "0": do not ask UCX to describe its choices
REPORT_SWITCH = "KV_CONNECTOR_UCX_REPORT"
_OFF = ("0", "n", "no", "false", "off")


class Setting(NamedTuple):
    """A UCX setting (its name without ``UCX_``) we give our agents unless the user set it."""

    key: str
    value: str
    why: str


UCX_DEFAULTS = (
    Setting(
        "CUDA_IPC_ENABLE_GET_ZCOPY",
        "y",
        "READs from another process's GPU on this node over cuda_ipc, also where NVML finds no "
        "NVLink (UCX turns cuda_ipc GET off there, and such a READ falls back to tcp)",
    ),
    Setting(
        "RMA_PPLN_ENABLE",
        "y",
        "WRITEs and READs between a GPU and another process's host memory pipelined through "
        "cuda_ipc / cuda_copy and shared memory instead of tcp (UCX applies it only where one "
        "end is not host memory)",
    ),
)

# NIXL's UCX plugin sets CUDA_IPC_ENABLE_GET_ZCOPY itself only after this release (ai-dynamo/
# nixl#2208, merged 2026-09-04; 1.5.1's plugin holds no such key): until then our default does
NIXL_WITHOUT_GET_ZCOPY = "1.5.1"
NIXL_GET_ZCOPY_PR = "ai-dynamo/nixl#2208"

# UCX tests this glob against a choice's short name ("put(multi) from cuda/GPU0 to host"),
# both before writing its file and before printing its table; the table's test uses the
# long name ("remote memory write by ucp_put*..."), which it does not match: files, no output
PUT_GET_ONLY = "[gp][eu]t*"


def switched_off(environ: Mapping[str, str], switch: str) -> bool:
    return environ.get(switch, "").strip().lower() in _OFF


_DEBUG_LEVELS = ("debug", "trace", "req", "data", "async", "func", "poll")


def _debug(environ: Mapping[str, str]) -> bool:
    return environ.get("UCX_LOG_LEVEL", "").strip().lower().startswith(_DEBUG_LEVELS)


def parse_engine_config(text: str) -> dict[str, str]:
    """NIXL's UCX ``engine_config`` (``KEY=VALUE,...``, keys without ``UCX_``) as a dict."""
    out: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def engine_config(
    environ: Mapping[str, str], given: str = "", report_dir: str | None = None
) -> tuple[str, list[Setting]]:
    """The ``engine_config`` for an agent: ``given`` (the caller's), then our defaults for
    keys neither it nor the environment (``UCX_<KEY>``) sets, unless ``DEFAULTS_SWITCH``
    is off, then, with ``report_dir``, the settings that make UCX describe its WRITE and
    READ choices in files there. Returns it and the defaults it applied. NIXL itself gives
    way to a ``UCX_<KEY>`` of the environment as well."""
    config = parse_engine_config(given)
    applied: list[Setting] = []
    if not switched_off(environ, DEFAULTS_SWITCH):
        for s in UCX_DEFAULTS:
            if s.key not in config and f"UCX_{s.key}" not in environ:
                config[s.key] = s.value
                applied.append(s)
    if report_dir is not None:
        asked = [("PROTO_INFO_DIR", report_dir)]
        # at debug UCX's "auto" describes (and prints) every choice
        if not _debug(environ):
            asked.append(("PROTO_INFO", PUT_GET_ONLY))
        for key, value in asked:
            if key not in config and f"UCX_{key}" not in environ:
                config[key] = value
    if any("," in v for v in config.values()):
        raise ConfigurationError(f"a UCX setting for NIXL's engine_config cannot hold a comma: {config}")
    return ",".join(f"{k}={v}" for k, v in config.items()), applied


class Op(enum.Enum):
    WRITE = "WRITE"
    READ = "READ"


class Mem(enum.Enum):
    HOST = "host memory"
    GPU = "GPU"


class Reach(enum.Enum):
    """Where the peer is, as UCX names its endpoint: itself, this node, or another."""

    SELF = "itself"
    SAME_NODE = "this node"
    OTHER_NODE = "another node"


class Kind(enum.Enum):
    """What a UCX transport is, for what it means to a GPU buffer."""

    TCP = "tcp"
    # a NIC writes the memory: GPUDirect RDMA when it is a GPU's
    RDMA = "rdma"
    # a CUDA copy between two processes' GPUs of one node
    CUDA_IPC = "cuda_ipc"
    # a CUDA copy between host and GPU memory of one process
    CUDA_COPY = "cuda_copy"
    # cma, sysv, posix, xpmem, knem
    SHARED_MEMORY = "shared_memory"
    SELF = "self"
    OTHER = "other"


_KINDS = {
    "tcp": Kind.TCP,
    "cuda_ipc": Kind.CUDA_IPC,
    "cuda_copy": Kind.CUDA_COPY,
    "cma": Kind.SHARED_MEMORY,
    "sysv": Kind.SHARED_MEMORY,
    "posix": Kind.SHARED_MEMORY,
    "xpmem": Kind.SHARED_MEMORY,
    "knem": Kind.SHARED_MEMORY,
    "self": Kind.SELF,
}
_RDMA = re.compile(r"^(rc|dc|ud|srd|gga|ib|efa)(_|$)")


def kind_of(transport: str) -> Kind:
    """The kind of a UCX transport as UCX names it (``tcp/lo``, ``rc_mlx5/mlx5_0:1``)."""
    name = transport.split("/", 1)[0]
    if name in _KINDS:
        return _KINDS[name]
    return Kind.RDMA if _RDMA.match(name) else Kind.OTHER


def any_rdma(transports: Iterable[str]) -> bool:
    """Whether a NIC may have written the bytes: a transport of kind RDMA, or one this
    module does not know (taken as RDMA, so a GPU pool flushes rather than not)."""
    return any(kind_of(t) in (Kind.RDMA, Kind.OTHER) for t in transports)


@dataclass(frozen=True)
class Pairing:
    """One kind of transfer an agent posts: ``local`` is its own buffer's memory."""

    op: Op
    local: Mem
    remote: Mem
    reach: Reach

    def __str__(self) -> str:
        if self.op is Op.WRITE:
            return f"WRITE from {self.local.value} to {self.remote.value} on {self.reach.value}"
        return f"READ into {self.local.value} from {self.remote.value} on {self.reach.value}"

    @property
    def gpu(self) -> bool:
        return Mem.GPU in (self.local, self.remote)


@dataclass(frozen=True)
class Choice:
    """What UCX chose for a pairing over one range of sizes (``last`` None: no end)."""

    pairing: Pairing
    first: int
    last: int | None
    transports: tuple[str, ...]


def sanitized(name: str) -> str:
    """A name as UCX writes it into a report file's name (``ucp_proto_debug_fix_filename``),
    cut where UCX cuts a context's name (31 characters)."""
    out = []
    for ch in name[:31]:
        if ch in "])}":
            continue
        out.append(ch if ch.isascii() and (ch.isalnum() or ch == "_") else "_")
    return "".join(out)


_FILE = re.compile(
    r"^(?P<reach>self|intra_node|inter_node)_cfg_\d+_"
    r"(?P<op>put|get)(?:_[a-z]+)*?_(?:from|into)_(?P<local>.+?)_(?:to|from)_(?P<remote>.+)"
    r"_(?P<first>\d+)_(?P<last>\d+|inf)\.dot$"
)
_LABEL = re.compile(r'node0 \[label="[^"\\]*\\n(?P<config>[^"]*)"')
# "cuda_ipc/cuda", "rc_mlx5/mlx5_0:1"
_TRANSPORT = re.compile(r"[a-z][a-z0-9_]*/[A-Za-z0-9_:.\-]+")
_REACH = {"self": Reach.SELF, "intra_node": Reach.SAME_NODE, "inter_node": Reach.OTHER_NODE}


def _mem(text: str) -> Mem:
    """``host_memory``, ``host`` -> host; ``cuda_GPU0``, ``cuda_dev1``, ``cuda`` -> GPU."""
    return Mem.HOST if text.startswith("host") else Mem.GPU


def choice_of(file_name: str, text: str, agent: str) -> Choice | None:
    """The choice a UCX report file of ``agent``'s describes: its name holds the endpoint's
    reach, the operation, both memories and the range of sizes (``a_intra_node_cfg_1_put_
    multi_from_cuda_GPU0_to_host_8173_inf.dot``), its first node the transports (``label=
    "zero-copy\\ncuda_ipc/cuda"``). None for another agent's file or one not of a WRITE or
    READ."""
    prefix = sanitized(agent) + "_"
    if not file_name.startswith(prefix):
        return None
    m = _FILE.match(file_name[len(prefix) :])
    label = _LABEL.search(text)
    if m is None or label is None:
        return None
    pairing = Pairing(
        Op.WRITE if m["op"] == "put" else Op.READ, _mem(m["local"]), _mem(m["remote"]), _REACH[m["reach"]]
    )
    last = None if m["last"] == "inf" else int(m["last"])
    return Choice(pairing, int(m["first"]), last, tuple(sorted(set(_TRANSPORT.findall(label["config"])))))


def bulk(choices: Iterable[Choice]) -> dict[Pairing, tuple[str, ...]]:
    """The transports that carry each pairing's large transfers (the range with no end;
    over UCX's variants of an operation, e.g. single and batched, together)."""
    out: dict[Pairing, set[str]] = {}
    for c in choices:
        if c.last is None:
            out.setdefault(c.pairing, set()).update(c.transports)
    return {p: tuple(sorted(ts)) for p, ts in out.items()}


def advice(pairing: Pairing, transports: Iterable[str]) -> str | None:
    """What to change where ``tcp`` carries a GPU buffer, in a sentence; None otherwise."""
    if not pairing.gpu or not any(kind_of(t) is Kind.TCP for t in transports):
        return None
    off = f"(this package's default unless {DEFAULTS_SWITCH}=0 or the environment sets it)"
    if pairing.reach is Reach.OTHER_NODE:
        return (
            "no RDMA device UCX may use carries it between these nodes, so the GPU buffer moves "
            "through host memory over tcp: GPUDirect RDMA needs an RDMA NIC on both nodes, "
            "reachable under UCX_TLS and UCX_NET_DEVICES"
        )
    if pairing.local is Mem.GPU and pairing.remote is Mem.GPU:
        if pairing.op is Op.READ:
            return (
                f"set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y {off}: UCX turns cuda_ipc READs off where "
                f"NVML finds no NVLink, and NIXL up to {NIXL_WITHOUT_GET_ZCOPY} does not turn them "
                f"back on (NIXL's UCX plugin sets it itself from {NIXL_GET_ZCOPY_PR}); or push "
                "instead of pull (a WRITE between GPUs of one node goes over cuda_ipc)"
            )
        return (
            "a WRITE between two GPUs of one node goes over cuda_ipc when UCX_TLS allows it and "
            "the posting thread has the GPU's CUDA context (UCX turns CUDA IPC off without one)"
        )
    faster = (
        "or keep both ends on GPUs (pool_device): between GPUs of one node UCX uses cuda_ipc"
        if pairing.op is Op.READ
        else "or push into a reader with node_pool=True, whose host pool this producer then maps and "
        "copies into (no UCX in the data path); or keep both ends on GPUs (pool_device)"
    )
    return (
        f"set UCX_RMA_PPLN_ENABLE=y {off}: UCX then pipelines it through cuda_ipc / cuda_copy and "
        f"shared memory; {faster}"
    )


_TITLE = re.compile(r"\|\s*(remote memory (?:write|read)[^|]*?)\s*\|")
# a row: "| 8K..inf | zero-copy | 50% on cuda_ipc/cuda and ... |"
_ROW = re.compile(r"\|\s*[0-9][0-9A-Za-z.]*\s*\|[^|]*\|\s*([^|]+?)\s*\|\s*$")


def table_transports(log: str) -> dict[str, list[str]]:
    """From UCX's protocol tables as it prints them (``UCX_PROTO_INFO=y``): for each
    remote-memory operation it selected a protocol for ("remote memory write by ucp_put*
    from cuda memory to host", ...), the transports it uses ("cuda_copy/cuda", ...)."""
    out: dict[str, set[str]] = {}
    title: str | None = None
    for line in log.splitlines():
        if m := _TITLE.search(line):
            title = m.group(1)
            continue
        if title is None:
            continue
        if m := _ROW.search(line):
            out.setdefault(title, set()).update(_TRANSPORT.findall(m.group(1)))
        elif "Range" not in line and "+--" not in line and "|" in line:
            title = None
    return {k: sorted(v) for k, v in sorted(out.items())}
