"""The design's switch (``HIDDEN_STATES_SUPPLEMENTARY``), its one log line, and the one
way this package says a thing once per process (``OncePerProcess``). Shared by the plugin
that installs the design and the runtime wrappers that carry it out (so neither imports
the other for it)."""

from __future__ import annotations

import logging

ENV = "HIDDEN_STATES_SUPPLEMENTARY"

log = logging.getLogger("vllm.hybrid.plugin")


class OncePerProcess:
    """Whether something was said in this process yet (``reset()``: as if not)."""

    def __init__(self) -> None:
        self.said = False

    def first(self) -> bool:
        """True the first time it is asked (after ``reset``), False after."""
        said, self.said = self.said, True
        return not said

    def reset(self) -> None:
        self.said = False


# the line saying the design is active
ANNOUNCED = OncePerProcess()


def announce() -> None:
    """Log, once per process, that the design is active. vLLM configures its logging
    after it loads plugins in its first process, so until then this waits: every patched
    function calls it again."""
    if not logging.getLogger("vllm").handlers or not ANNOUNCED.first():
        return
    import vllm

    log.info(
        "hybrid supplementary tensors active (vLLM %s): the cache-only layer of a hybrid model gets its own "
        "tensor, addressed by the full-attention group (%s=0 turns this off)",
        vllm.__version__,
        ENV,
    )
