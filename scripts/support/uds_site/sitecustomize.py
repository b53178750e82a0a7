"""In a process whose PYTHONPATH holds this folder and whose environment names
``KV_TEST_OPENAI_UDS``, ``openai.OpenAI`` clients talk HTTP over that Unix socket (vLLM's
server, ``scripts.support.vllm_server``, listens on one, so no TCP port is picked and
released). Python runs a ``sitecustomize`` at start in every process, DataLoader workers
spawned by speculators included. Used by the benchmark's loaders and the e2e tests."""

import os

_UDS = os.environ.get("KV_TEST_OPENAI_UDS")

if _UDS:
    import httpx
    import openai

    _OpenAI = openai.OpenAI

    class _UdsOpenAI(_OpenAI):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            kwargs.setdefault("http_client", httpx.Client(transport=httpx.HTTPTransport(uds=_UDS)))
            super().__init__(*args, **kwargs)

    openai.OpenAI = _UdsOpenAI  # type: ignore[misc]
