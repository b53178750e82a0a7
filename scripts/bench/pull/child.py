"""A spawned process answering ``(name, *args)`` commands over a pipe: the READ
pairings' producer and consumer."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from typing import Any


def serve_commands(conn: Any, handlers: dict[str, Callable[..., Any]]) -> None:
    """Answer ``(name, *args)`` messages until "quit"; an exception goes back as
    ("error", traceback) instead of killing the process silently."""
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[msg[0]](*msg[1:])))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class Child:
    """``target(conn, *args)`` in a spawned process; ``call`` sends it a command and
    returns its answer."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *msg: Any, timeout_s: float = 300.0) -> Any:
        self.conn.send(msg)
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"{msg[0]}: the process died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{msg[0]}: no answer in {timeout_s} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{msg[0]} failed in the child:\n{value}")
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.call("quit", timeout_s=30)
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()
