"""Processes as /proc shows them, for the benchmark and the tests that count what a
trainer rank runs: the processes under one, and which of them made a NIXL agent."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (by their parents in /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def made_a_nixl_agent(pid: int | str = "self") -> bool:
    """Whether process ``pid`` made a NIXL agent: its UCX backend's plugin is mapped (an
    import of nixl alone does not map it). False for a process that is gone."""
    try:
        return "libplugin_UCX" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def spawned_workers(pids: list[int]) -> list[int]:
    """Which of ``pids`` are multiprocessing's spawned children (a DataLoader's workers),
    not its resource tracker nor any other process."""
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out.append(pid)
    return out


def pss_mib(pid: int) -> float:
    """Process ``pid``'s proportional set size in MiB (its share of memory it shares with
    others, counted once over them all); 0 for a process that is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
