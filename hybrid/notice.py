"""The design's switch (``HIDDEN_STATES_SUPPLEMENTARY``) and its one log line, shared by
the plugin that installs the design and the runtime wrappers that carry it out (so
neither imports the other for it)."""

from __future__ import annotations

import logging

ENV = "HIDDEN_STATES_SUPPLEMENTARY"

log = logging.getLogger("vllm.hybrid.plugin")
_announced = False


def announce() -> None:
    """Log, once per process, that the design is active. vLLM configures its logging
    after it loads plugins in its first process, so until then this waits: every patched
    function calls it again."""
    global _announced
    if _announced or not logging.getLogger("vllm").handlers:
        return
    _announced = True
    import vllm

    log.info(
        "hybrid supplementary tensors active (vLLM %s): the cache-only layer of a hybrid model gets its own "
        "tensor, addressed by the full-attention group (%s=0 turns this off)",
        vllm.__version__,
        ENV,
    )
