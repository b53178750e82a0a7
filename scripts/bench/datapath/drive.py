"""How the two vLLM arms (e: ours, b: vLLM's example connector) feed a harness rank."""

from __future__ import annotations

import time
from typing import Any


def drive(rank: Any, n_req: int, tokens: int, prefix: str = "q") -> float:
    """Admit requests as blocks free up, step until every one is reported sent."""
    pending = [f"{prefix}{i}" for i in range(n_req)]
    done: set[str] = set()
    prompt = list(range(tokens))
    t0 = time.time()
    while len(done) < n_req:
        admitted = False
        while pending and rank.can_admit(tokens):
            rank.add(pending.pop(0), prompt)
            admitted = True
        finished = rank.step().finished_sending
        done |= finished
        if not admitted and not finished:
            time.sleep(0.0005)  # an idle engine step; a real engine would not spin either
    return t0
