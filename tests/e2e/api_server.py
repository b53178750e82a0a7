"""vLLM's OpenAI-compatible server for e2e tests: ``scripts.support.vllm_server``'s launcher
(the benchmark's too) with this project's connector, fp32 and a small KV cache; a server
that exits or is not healthy in time fails the test with its log's tail."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from scripts.support.vllm_server import STARTUP_DEADLINE_S, ServerFailed, VllmServer, connector_config, tail
from tests.engines import Start

__all__ = ["ApiServer", "tail"]


class ApiServer(VllmServer):
    """``with ApiServer(model, kv_connector_extra_config, layer_ids, tmp) as server:``
    starts the server and waits until it is healthy; ``server.http`` talks to it."""

    def __init__(
        self,
        model: Path,
        extra_config: dict[str, Any],
        layer_ids: Sequence[int],
        workdir: Path,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        start: Start = Start.FRESH,
    ) -> None:
        super().__init__(model, connector_config(extra_config), layer_ids, workdir, args=args, env=env)
        self.start_kind = start  # how the suite's engine count counts it (tests/conftest.py)

    def __enter__(self) -> ApiServer:
        super().__enter__()
        return self

    def wait_healthy(self, deadline_s: float = STARTUP_DEADLINE_S) -> float:
        try:
            seconds = super().wait_healthy(deadline_s)
        except ServerFailed as e:
            pytest.fail(str(e))
        print(f"server healthy after {seconds:.1f} s")
        return seconds
