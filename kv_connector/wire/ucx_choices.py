"""What UCX chose for this process's NIXL agents, and where it describes its choices.

UCX describes each choice in a file of a directory (``report_dir``: the user's
``UCX_PROTO_INFO_DIR``, else one of our own, removed with its agent; those of processes
that are gone are pruned). Each agent records, per pairing, the transports it read back
(``record``); ``ucx_choices`` is the process's record, for logs and reports. It reads
files and holds state, where ``ucx_report`` is pure; nothing here imports nixl."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterable

from kv_connector.wire import ucx_report

# (agent, pairing) -> transports
_CHOICES: dict[tuple[str, ucx_report.Pairing], tuple[str, ...]] = {}
_LOCK = threading.Lock()
# then the pid: directories of processes gone are pruned
_REPORT_PREFIX = "kvc-ucx-"


def ucx_choices() -> dict[str, dict[str, list[str]]]:
    """What UCX chose in this process, as its agents read it: agent -> pairing -> the
    transports of its large transfers (``node_pool`` for WRITEs into a mapped pool)."""
    out: dict[str, dict[str, list[str]]] = {}
    with _LOCK:
        for (agent, pairing), ts in sorted(_CHOICES.items(), key=lambda x: (x[0][0], str(x[0][1]))):
            out.setdefault(agent, {})[str(pairing)] = list(ts)
    return out


def record(agent: str, pairing: ucx_report.Pairing, transports: Iterable[str]) -> tuple[str, ...] | None:
    """Add ``transports`` to what ``agent`` uses for ``pairing`` (variants may come in later
    reads); the whole set when it grew, None when nothing was new."""
    key = (agent, pairing)
    with _LOCK:
        before = _CHOICES.get(key, ())
        now = tuple(sorted(set(before) | set(transports)))
        if now == before:
            return None
        _CHOICES[key] = now
        return now


def report_dir() -> tuple[str | None, bool]:
    """Where UCX describes an agent's choices, and whether the directory is ours to
    remove: the user's ``UCX_PROTO_INFO_DIR`` (``%p``, ``%h`` filled in as UCX does),
    else a new temporary one; None when ``KV_CONNECTOR_UCX_REPORT`` is off."""
    if ucx_report.switched_off(os.environ, ucx_report.REPORT_SWITCH):
        return None, False
    theirs = os.environ.get("UCX_PROTO_INFO_DIR")
    if theirs:
        return theirs.replace("%p", str(os.getpid())).replace("%h", socket.gethostname()), False
    _prune_reports()
    # short: UCX cuts a report file's whole path at 255 bytes
    return tempfile.mkdtemp(prefix=f"{_REPORT_PREFIX}{os.getpid()}-"), True


def _prune_reports() -> None:
    """Remove the report directories of processes that are gone (killed before their
    agents closed); a directory holds only the descriptions not read yet."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            pid = entry.name.removeprefix(_REPORT_PREFIX).split("-", 1)[0]
            if entry.name.startswith(_REPORT_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # another user's: alive
    except OSError:
        return True
    return True
