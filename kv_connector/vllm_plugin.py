"""The vLLM plugin every process of a vLLM with this package runs first: ``register()``.

Declared as a ``vllm.general_plugins`` entry point, so vLLM calls it in its front end,
engine core and workers before any model runs. It asks for Intel AMX tile data on CPUs
that have it (``kv_connector.common.amx``): vLLM's CPU attention runs AMX instructions
without asking, and dies by SIGILL when nothing asked before it.
"""

from __future__ import annotations

from kv_connector.common.amx import request_amx


def register() -> None:
    request_amx()
