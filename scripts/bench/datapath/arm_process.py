"""Each arm in a process of its own, built once and told to run one round at a time
(``ArmProcess``); the child builds its arm from the class's name (``ARMS``), so every arm
class a benchmark names is listed there. ``isolated`` runs one function (``FUNCTIONS``) in
a fresh process."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from scripts.bench.datapath.example import ExampleArm
from scripts.bench.datapath.ours import OursArm
from scripts.bench.datapath.raw import RawArm
from scripts.bench.datapath.raw_engine import RawEngineArm
from scripts.bench.datapath.values import bench_values_check
from scripts.bench.paired import Run


class Arm(Protocol):
    """What ``_serve_arm`` asks of an arm: a round's figures (``seconds``, ``units``,
    ``nbytes``, ``cpu_s`` and its extras), and at the end its closing report."""

    def round(self) -> dict[str, float]: ...

    def close(self) -> dict[str, float]: ...


# the arms a child process builds by name (a spawned child gets the name, not the class)
ARMS: dict[str, Callable[..., Arm]] = {
    "OursArm": OursArm, "ExampleArm": ExampleArm, "RawArm": RawArm, "RawEngineArm": RawEngineArm,
}  # fmt: skip
# the functions ``isolated`` runs by name
FUNCTIONS: dict[str, Callable[..., dict[str, float]]] = {"bench_values_check": bench_values_check}


class ArmProcess:
    """One arm in a process of its own (spawned: vLLM's global state is per process),
    built once; ``round()`` runs one measurement there and returns its ``Run`` and the
    arm's own extras; ``close()`` ends it and returns what the arm reports at the end."""

    def __init__(self, cls_name: str, *args: Any) -> None:
        self.name = cls_name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_arm, args=(cls_name, child, *args))
        self._proc.start()
        self._ready = False

    def ready(self) -> ArmProcess:
        if not self._ready:
            self._answer()
            self._ready = True
        return self

    def _answer(self) -> Any:
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"{self.name} died (exit code {self._proc.exitcode})")
        status, payload = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.name} failed:\n{payload}")
        return payload

    def round(self) -> Run:
        self.ready()
        self._conn.send("round")
        got: dict[str, float] = self._answer()
        return Run(got.pop("seconds"), got.pop("units"), got.pop("nbytes"), got.pop("cpu_s"), got)

    def close(self) -> dict[str, float]:
        try:
            self.ready()
            self._conn.send("stop")
            final: dict[str, float] = self._answer()
            return final
        finally:
            self._proc.join(60)
            if self._proc.is_alive():
                self._proc.kill()


def _serve_arm(cls_name: str, conn: Any, *args: Any) -> None:
    try:
        arm = ARMS[cls_name](*args)
        conn.send(("ok", None))
        while (cmd := conn.recv()) != "stop":
            assert cmd == "round", cmd
            conn.send(("ok", arm.round()))
        conn.send(("ok", arm.close()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def one_round(cls_name: str, *args: Any) -> dict[str, float]:
    """Build an arm in its own process, run one round, close it: the round's figures and
    the arm's closing report in one dict (what the arms' tests check)."""
    arm = ArmProcess(cls_name, *args)
    try:
        run = arm.round()
    except BaseException:
        arm._proc.kill()
        raise
    final = arm.close()
    return {
        "seconds": run.seconds, "tokens": run.units, "bytes": run.nbytes, "cpu_s": run.cpu_s,
        **run.detail, **final,
    }  # fmt: skip


def _run(fn_name: str, conn: Any, *args: Any) -> None:
    conn.send(FUNCTIONS[fn_name](*args))


def isolated(fn_name: str, *args: Any) -> dict[str, float]:
    """Run one function in a fresh process."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_run, args=(fn_name, b, *args))
    p.start()
    while not a.poll(1.0):
        if not p.is_alive():
            raise RuntimeError(f"{fn_name} died (exit code {p.exitcode})")
    res: dict[str, float] = a.recv()
    p.join(60)
    return res
