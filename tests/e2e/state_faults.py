"""Faults in what vLLM computes and captures, injected into a producer's own process
(``producer_main.py``, spec ``faults``): the kind no checksum sees, because the connector
ships faithfully what vLLM wrote. A request chooses its fault by its prompt's first token
(``faults``: token -> name); requests must run one at a time (``max_num_seqs`` 1).

- ``layer_before``: the last captured layer holds the states of the layer before it;
- ``shift``: every layer's states shifted by one token;
- ``other``: the previous request's states (prompts of equal length);
- ``zeros``: the second captured layer all zeros;
- ``short``: the prompt's last position not written (slot -1 for its row);
- ``input``: the prompt's second position computed from another token;
- ``output``: the first decode step computed from another token than the one committed.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB_STEP = 7  # what a corrupted input id is moved by


class _State:
    fault: str | None = None  # this step's fault
    decode_fault: bool = False  # the next step's first row is corrupted ("output")
    previous: list[torch.Tensor] | None = None  # the last step's captured states


def install(faults: dict[int, str]) -> None:
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    state = _State()
    forward = GPUModelRunner._model_forward
    propose = ExtractHiddenStatesProposer.propose
    slot_mapping = ExtractHiddenStatesProposer._get_slot_mapping

    def faulty_forward(self: Any, input_ids: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        state.fault = None
        if input_ids is not None and input_ids.numel() > 1:
            if state.decode_fault:
                state.decode_fault = False
                input_ids[0] = (input_ids[0] + VOCAB_STEP) % 100
            else:
                state.fault = faults.get(int(input_ids[0]))
                if state.fault == "input":
                    input_ids[1] = (input_ids[1] + VOCAB_STEP) % 100
                state.decode_fault = state.fault == "output"
        return forward(self, input_ids, *args, **kwargs)

    def faulty_propose(self: Any, *args: Any, **kw: Any) -> Any:
        named = "target_hidden_states" in kw
        hs: list[torch.Tensor] = kw["target_hidden_states"] if named else args[2]
        captured = [h.clone() for h in hs]
        if state.fault == "layer_before":
            hs = [*hs[:-1], hs[-2]]
        elif state.fault == "shift":
            hs = [torch.roll(h, 1, dims=0) for h in hs]
        elif state.fault == "other" and state.previous is not None:
            hs = [p[: h.shape[0]] for p, h in zip(state.previous, hs, strict=True)]
        elif state.fault == "zeros":
            hs = [hs[0], torch.zeros_like(hs[1]), *hs[2:]]
        state.previous = captured
        if named:
            kw["target_hidden_states"] = hs
        else:
            args = (*args[:2], hs, *args[3:])
        return propose(self, *args, **kw)

    def faulty_slots(
        self: Any, num_tokens: int, slots: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        out = slot_mapping(self, num_tokens, slots)
        if state.fault == "short" and slots is not None:
            for view in out.values():
                view[slots.shape[0] - 1] = -1
        return out

    GPUModelRunner._model_forward = faulty_forward  # type: ignore[method-assign]
    ExtractHiddenStatesProposer.propose = faulty_propose  # type: ignore[method-assign]
    ExtractHiddenStatesProposer._get_slot_mapping = faulty_slots  # type: ignore[method-assign]
