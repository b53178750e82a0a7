"""Stand-in for vLLM 0.33's compiled ``vllm._moe_C_stable_libtorch`` on a GPU host it cannot
reach: it defines, in torch's ``_moe_C`` op namespace, the three ops a small unquantized
MoE model (Qwen3-Next) calls on vLLM's default Triton fused-MoE path, in native torch.

The engine tier copies this file over ``vllm/_moe_C_stable_libtorch.py`` of the unpacked
vLLM tree (platforms/cuda.py imports it under ``contextlib.suppress(ImportError)``, so
without it ``torch.ops._moe_C`` stays empty); it imports nothing but torch. The ops, with
the schemas vLLM 0.33's ``_custom_ops.py`` calls them by:

- ``topk_softmax``: the router's softmax over the gating logits (fp32), its top-k expert
  weights and ids (renormalized if asked; selection by softmax + correction bias where a
  bias is given; padding tokens routed nowhere: id -1, weight 0);
- ``moe_align_block_size``: the flat (token, slot) indices grouped by expert, each group
  padded to a multiple of the block size with the sentinel ``topk_ids.numel()``, one
  expert id per block (-1 past the last), and the padded total, which the Triton
  fused-MoE kernel reads;
- ``moe_sum``: the sum of each token's top-k expert outputs (in fp32), skipping the slots
  routed nowhere or off this rank where ``topk_ids``/``expert_map`` are given.

Each computes with sort, cumsum, scatter, gather and searchsorted into the buffers its
caller preallocated, free of host syncs (no ``.item()``, no ``nonzero``, no boolean
indexing, no shape or branch that depends on a tensor's values), so it can run inside
vLLM's piecewise CUDA graphs. ``DEFINED`` lists what was defined and ``FAILED`` what
could not be (name -> error), so the engine tier can report them. Unrun on a GPU until
the engine tier runs there.
"""

from __future__ import annotations

from typing import Any

import torch

DEFINED: list[str] = []
FAILED: dict[str, str] = {}

LIB = torch.library.Library("_moe_C", "FRAGMENT")

# vLLM 0.33's _custom_ops.py: topk_softmax (~2362), moe_align_block_size (~2199: the CUDA
# call passes expert_map and scatter_idx), moe_sum (~2190: topk_ids, expert_map)
SCHEMAS = {
    "topk_softmax": (
        "topk_softmax(Tensor(a!) topk_weights, Tensor(b!) topk_indices, Tensor(c!) token_expert_indices, "
        "Tensor gating_output, bool renormalize, Tensor? bias, Tensor? is_padding) -> ()"
    ),
    "moe_align_block_size": (
        "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
        "Tensor(a!) sorted_token_ids, Tensor(b!) experts_ids, Tensor(c!) num_tokens_post_pad, "
        "Tensor? maybe_expert_map, Tensor(d!)? scatter_idx=None) -> ()"
    ),
    "moe_sum": (
        "moe_sum(Tensor input, Tensor(a!) output, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()"
    ),
}


def topk_softmax(
    topk_weights: torch.Tensor,
    topk_indices: torch.Tensor,
    token_expert_indices: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool,
    bias: torch.Tensor | None = None,
    is_padding: torch.Tensor | None = None,
) -> None:
    """Top-k of ``softmax(gating_output)`` per token into the three [T, k] outputs: the
    weights (unbiased softmax values, over their sum if ``renormalize``), the expert ids
    (ranked by softmax + ``bias``; ties to the lower id, as the kernel's arg-max) and each
    slot's source row ``slot * T + token``. Padding tokens get id -1 and weight 0."""
    k = topk_weights.shape[-1]
    num_experts = gating_output.shape[-1]
    probs = torch.softmax(gating_output.reshape(-1, num_experts).float(), dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0, posinf=0.0, neginf=0.0)
    scores = probs if bias is None else probs + bias.float()
    ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(1, ids)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    if is_padding is not None:
        pad = is_padding.reshape(-1, 1).bool()
        weights = torch.where(pad, torch.zeros_like(weights), weights)
        ids = torch.where(pad, torch.full_like(ids, -1), ids)
    num_tokens = probs.shape[0]
    rows = torch.arange(num_tokens, device=probs.device).unsqueeze(1)
    slots = torch.arange(k, device=probs.device).unsqueeze(0)
    topk_weights.copy_(weights.reshape(topk_weights.shape))
    topk_indices.copy_(ids.reshape(topk_indices.shape))
    token_expert_indices.copy_((slots * num_tokens + rows).reshape(token_expert_indices.shape))


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    maybe_expert_map: torch.Tensor | None = None,
    scatter_idx: torch.Tensor | None = None,
) -> None:
    """Group the flat indices of ``topk_ids`` by (local) expert, in index order, each
    group padded up to a multiple of ``block_size`` with the sentinel ``topk_ids.numel()``;
    every slot of ``sorted_token_ids`` past the padded total holds the sentinel too. One
    expert id per block in ``experts_ids`` (-1 past the padded total), the padded total in
    ``num_tokens_post_pad``. Ids outside ``[0, num_experts)``, or mapped to -1 by
    ``maybe_expert_map``, take no part; ``scatter_idx`` gets each flat index, or -1 where it
    took none."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    device = flat.device
    in_range = (flat >= 0) & (flat < num_experts)
    expert = flat
    if maybe_expert_map is not None:
        mapped = maybe_expert_map.long().index_select(0, flat.clamp(0, num_experts - 1))
        expert = torch.where(in_range, mapped, torch.full_like(mapped, -1))
    valid = in_range & (expert >= 0) & (expert < num_experts)
    key = torch.where(valid, expert, torch.full_like(expert, num_experts))  # the last bucket: no expert

    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_size - 1) // block_size * block_size
    padded_ends = padded.cumsum(0)
    cap = sorted_token_ids.numel()
    # where each expert's group starts; the no-expert bucket lands on a dump slot past the end
    padded_starts = torch.nn.functional.pad(padded_ends - padded, (0, 1), value=cap)
    compact_starts = counts.cumsum(0) - counts

    order = torch.sort(key, stable=True).indices  # flat indices by expert, in index order
    sorted_key = key.gather(0, order)
    rank = torch.arange(n, device=device) - compact_starts.gather(0, sorted_key)
    dest = torch.where(sorted_key < num_experts, padded_starts.gather(0, sorted_key) + rank, cap)
    out = torch.full((cap + 1,), n, dtype=sorted_token_ids.dtype, device=device)
    out.scatter_(0, dest.clamp(max=cap), order.to(out.dtype))
    sorted_token_ids.copy_(out[:cap].reshape(sorted_token_ids.shape))

    total = padded_ends[-1:]
    block_starts = torch.arange(experts_ids.numel(), device=device) * block_size
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    experts_ids.copy_(
        torch.where(block_starts < total, block_expert, torch.full_like(block_expert, -1)).reshape(
            experts_ids.shape
        )
    )
    num_tokens_post_pad.copy_(total.reshape(num_tokens_post_pad.shape))
    if scatter_idx is not None:
        rows = torch.arange(n, device=device)
        scatter_idx.copy_(torch.where(valid, rows, torch.full_like(rows, -1)).reshape(scatter_idx.shape))


def moe_sum(
    input: torch.Tensor,
    output: torch.Tensor,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> None:
    """``output[t] = sum_k input[t, k]`` in fp32; with ``topk_ids``, the slots routed
    nowhere (id < 0) or, with ``expert_map``, to an expert off this rank are left out."""
    x = input.float()
    if topk_ids is not None:
        ids = topk_ids.long()
        keep = ids >= 0
        if expert_map is not None:
            size = expert_map.numel()
            local = expert_map.long().index_select(0, ids.clamp(0, size - 1).reshape(-1)).view_as(ids)
            keep = keep & (ids < size) & (local >= 0)
        x = torch.where(keep.unsqueeze(-1), x, torch.zeros_like(x))
    output.copy_(x.sum(dim=1).reshape(output.shape))


def _nothing(*args: Any) -> None:
    return None


def _define(name: str, schema: str, impls: dict[str, Any]) -> None:
    try:
        LIB.define(schema)
        for key, fn in impls.items():
            LIB.impl(name, fn, key)
    except Exception as e:  # report each op, define the rest
        FAILED[name] = f"{type(e).__name__}: {e}"
    else:
        DEFINED.append(name)


def _define_all() -> None:
    native = {"topk_softmax": topk_softmax, "moe_align_block_size": moe_align_block_size, "moe_sum": moe_sum}
    for name, fn in native.items():  # every op writes into its arguments: nothing to shape on Meta
        _define(name, SCHEMAS[name], {"CPU": fn, "CUDA": fn, "Meta": _nothing})


_define_all()
