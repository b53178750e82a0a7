"""The input ids of the step the engine just ran, found in vLLM's model runner.

vLLM hands a connector no input ids; its model runner keeps the step's in a persistent
buffer that holds them until the next step is prepared, which is after ``wait_for_save``.
The runner is found once on the call stack of ``wait_for_save`` (its ``self``): the V1
runner's ``input_ids.gpu``, Model Runner V2's ``input_buffers.input_ids``.
"""

from __future__ import annotations

from typing import Any

import torch

# how far up the stack the runner is looked for
MAX_FRAMES = 12


def input_ids_of(runner: object) -> torch.Tensor | None:
    """The runner's buffer of the step's input ids (first rows: this step's tokens)."""
    v1 = getattr(getattr(runner, "input_ids", None), "gpu", None)
    if isinstance(v1, torch.Tensor) and v1.dim() == 1:
        return v1
    v2 = getattr(getattr(runner, "input_buffers", None), "input_ids", None)
    if isinstance(v2, torch.Tensor) and v2.dim() == 1:
        return v2
    return None


def find_input_ids(frame: Any) -> torch.Tensor | None:
    """The step's input-id buffer of the first model runner on the stack above ``frame``
    (None where no frame's ``self`` has one)."""
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        found = input_ids_of(frame.f_locals.get("self"))
        if found is not None:
            return found
        frame = frame.f_back
    return None
