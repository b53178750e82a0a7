"""The engine tier's stand-in for vLLM 0.33's compiled MoE ops (``scripts/gpu/stand_in_moe.py``)
computes what vLLM's CUDA kernels compute, the way vLLM's Triton fused-MoE path uses them:
a dense MoE through ``topk_softmax`` -> ``moe_align_block_size`` -> a plain-torch walk of
the Triton kernel's blocks -> ``moe_sum`` equals a token-by-token fp32 reference; each op
meets its own contract (softmax + top-k, groups padded with the sentinel, the tail as
vLLM's kernel leaves it, the top-k sum); none of them syncs with the host or shapes
anything by a tensor's values; and, in a process of its own, ``torch.ops._moe_C`` holds all
three with the argument lists vLLM 0.33's ``_custom_ops.py`` passes.

vLLM is never imported here: the stand-in's functions are called directly."""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from scripts.gpu import stand_in_moe as s

REPO = Path(__file__).resolve().parents[2]
CUSTOM_OPS_033 = REPO / ".venv" / "vllm-0.33" / "vllm" / "_custom_ops.py"


def align_buffers(numel: int, num_experts: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """The buffers vLLM 0.33's ``moe_align_block_size`` (fused_moe/moe_align_block_size.py)
    allocates: the largest padded total, one expert id per block of it, the total."""
    cap = numel + num_experts * (block_size - 1)
    if numel < num_experts:
        cap = min(numel * block_size, cap)
    sorted_ids = torch.full((cap,), -7, dtype=torch.int32)  # garbage the op must overwrite
    expert_ids = torch.full(((cap + block_size - 1) // block_size,), -7, dtype=torch.int32)
    return sorted_ids, expert_ids, torch.full((1,), -7, dtype=torch.int32)


def align(
    topk_ids: torch.Tensor, num_experts: int, block_size: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sorted_ids, expert_ids, total = align_buffers(topk_ids.numel(), num_experts, block_size)
    s.moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, expert_ids, total, expert_map)
    return sorted_ids, expert_ids, total


def route(
    logits: torch.Tensor, k: int, renormalize: bool, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = logits.shape[0]
    weights, ids = torch.empty(t, k), torch.empty(t, k, dtype=torch.int32)
    sources = torch.empty(t, k, dtype=torch.int32)
    s.topk_softmax(weights, ids, sources, logits, renormalize, kw.get("bias"), kw.get("is_padding"))
    return weights, ids, sources


# ---- the MoE end to end -----------------------------------------------------------------


def reference_moe(
    x: torch.Tensor, logits: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, k: int, renormalize: bool
) -> torch.Tensor:
    """Token by token in fp32: softmax, the k largest, SiLU(gate) * up through each chosen
    expert, weighted and summed."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        probs = [float(p) for p in torch.softmax(logits[t].double(), 0)]
        chosen = sorted(range(len(probs)), key=lambda e: (-probs[e], e))[:k]
        norm = sum(probs[e] for e in chosen) if renormalize else 1.0
        for e in chosen:
            h = w1[e] @ x[t]
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += (probs[e] / norm) * (w2[e] @ act)
    return out


def fused_moe_kernel(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    total: torch.Tensor,
    block_size: int,
    top_k: int,
    num_valid: int,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's Triton ``fused_moe_kernel`` as a loop over its blocks: a block at or past
    ``num_tokens_post_padded`` does nothing, a block of expert -1 writes zeros, a row
    holding the sentinel (``>= num_valid``) is skipped; row ``r`` reads A's row
    ``r // top_k`` and writes C's row ``r``. C starts as NaN (``torch.empty``'s garbage),
    so a row no block writes poisons the sum."""
    c = torch.full((num_valid, w.shape[1]), float("nan"))
    for b in range(expert_ids.numel()):
        if b * block_size >= int(total[0]):
            break
        e = int(expert_ids[b])
        for r in (int(i) for i in sorted_ids[b * block_size : (b + 1) * block_size]):
            if r >= num_valid:
                continue
            if e == -1:
                c[r] = 0.0
                continue
            c[r] = w[e] @ a[r // top_k]
            if weights is not None:
                c[r] *= weights.reshape(-1)[r]
    return c


def stand_in_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    k: int,
    renormalize: bool,
    block_size: int,
) -> torch.Tensor:
    """The MoE as vLLM 0.33's TritonExperts runs it, with the stand-in's three ops."""
    t, num_experts, inter = x.shape[0], w1.shape[0], w2.shape[-1]
    weights, ids, _ = route(logits, k, renormalize)
    sorted_ids, expert_ids, total = align(ids, num_experts, block_size)
    cache1 = fused_moe_kernel(x, w1, sorted_ids, expert_ids, total, block_size, k, t * k)
    cache2 = torch.nn.functional.silu(cache1[:, :inter]) * cache1[:, inter:]
    cache3 = fused_moe_kernel(cache2, w2, sorted_ids, expert_ids, total, block_size, 1, t * k, weights)
    out = torch.empty(t, w2.shape[1])
    s.moe_sum(cache3.view(t, k, -1), out)
    return out


@pytest.mark.parametrize(
    ("tokens", "num_experts", "k", "block_size", "renormalize"),
    list(itertools.product((1, 7, 64), (4, 8), (1, 2), (16, 64), (False, True))),
)
def test_a_moe_through_the_stand_ins_equals_the_token_by_token_reference(
    tokens: int, num_experts: int, k: int, block_size: int, renormalize: bool
) -> None:
    g = torch.Generator().manual_seed(tokens * 1000 + num_experts * 10 + k)
    hidden, inter = 12, 8
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, num_experts, generator=g)
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    got = stand_in_moe(x, logits, w1, w2, k, renormalize, block_size)
    want = reference_moe(x, logits, w1, w2, k, renormalize)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- each op's contract -----------------------------------------------------------------


def test_topk_softmax_is_softmax_then_top_k_renormalized_only_when_asked() -> None:
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, 3)
    for renormalize in (False, True):
        weights, ids, sources = route(logits, 3, renormalize)
        want = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
        assert ids.dtype == torch.int32 and torch.equal(ids.long(), top.indices)
        torch.testing.assert_close(weights, want)
        # the kernel's source rows: slot-major, k * num_tokens + token
        assert sources.tolist() == [[slot * 9 + t for slot in range(3)] for t in range(9)]
    assert not torch.allclose(route(logits, 3, True)[0], route(logits, 3, False)[0])


def test_topk_softmax_writes_ids_in_the_dtype_given_and_breaks_ties_to_the_lower_expert() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5]])
    weights, ids, sources = torch.empty(1, 2), torch.empty(1, 2, dtype=torch.int64), torch.empty(1, 2)
    s.topk_softmax(weights, ids, sources, logits, False, None, None)
    assert ids.tolist() == [[1, 2]]


def test_topk_softmax_ranks_by_the_correction_bias_but_weighs_without_it() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    weights, ids, _ = route(logits, 2, False, bias=torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(weights[0], probs[[3, 0]])


def test_padding_tokens_are_routed_nowhere_and_aligned_nowhere() -> None:
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    is_padding = torch.tensor([False, True, False, True])
    weights, ids, _ = route(logits, 2, True, is_padding=is_padding)
    real_weights, real_ids, _ = route(logits, 2, True)
    assert ids[1].tolist() == ids[3].tolist() == [-1, -1]
    assert weights[1].tolist() == weights[3].tolist() == [0.0, 0.0]
    assert torch.equal(ids[[0, 2]], real_ids[[0, 2]]) and torch.equal(weights[[0, 2]], real_weights[[0, 2]])
    sorted_ids, _, total = align(ids, 8, 16)
    routed = {int(i) for i in sorted_ids if int(i) < ids.numel()}
    assert routed == {0, 1, 4, 5} and int(total[0]) % 16 == 0


def test_moe_align_block_size_on_a_worked_example() -> None:
    # flat: [2, 0, 1, 2, 0, 2]: expert 0 holds 1, 4; expert 1 holds 2; expert 2 holds 0, 3, 5
    topk_ids = torch.tensor([[2, 0], [1, 2], [0, 2]], dtype=torch.int32)
    sorted_ids, expert_ids, total = align(topk_ids, 4, 4)
    sentinel = 6
    assert sorted_ids.tolist() == [1, 4, 6, 6, 2, 6, 6, 6, 0, 3, 5, 6] + [sentinel] * 6
    assert expert_ids.tolist() == [0, 1, 2, -1, -1]  # expert 3 has no block; -1 past the total
    assert total.tolist() == [12]


@pytest.mark.parametrize(
    ("tokens", "num_experts", "k", "block_size"), [(1, 8, 2, 16), (33, 4, 2, 8), (50, 8, 3, 4)]
)
def test_moe_align_block_size_groups_each_experts_tokens_in_order_padded_to_the_block(
    tokens: int, num_experts: int, k: int, block_size: int
) -> None:
    g = torch.Generator().manual_seed(tokens)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)]).int()
    sorted_ids, expert_ids, total = align(topk_ids, num_experts, block_size)
    flat, numel = topk_ids.reshape(-1).tolist(), topk_ids.numel()
    start = 0
    for e in range(num_experts):
        mine = [i for i, x in enumerate(flat) if x == e]
        padded = -(-len(mine) // block_size) * block_size
        group = sorted_ids[start : start + padded].tolist()
        assert group == mine + [numel] * (padded - len(mine)), e
        assert expert_ids[start // block_size : (start + padded) // block_size].tolist() == [e] * (
            padded // block_size
        )
        start += padded
    assert total.tolist() == [start]
    assert sorted_ids[start:].tolist() == [numel] * (sorted_ids.numel() - start)
    assert expert_ids[start // block_size :].tolist() == [-1] * (expert_ids.numel() - start // block_size)


def test_moe_align_block_size_leaves_out_invalid_and_off_rank_experts() -> None:
    topk_ids = torch.tensor([[3, -1], [1, 4], [0, 1]], dtype=torch.int32)  # -1 and 4 are no expert
    sorted_ids, expert_ids, total = align(topk_ids, 4, 2)
    assert sorted_ids[: int(total[0])].tolist() == [4, 6, 2, 5, 0, 6]
    assert expert_ids.tolist()[:3] == [0, 1, 3]
    # global experts 1 and 3 live here as local 0 and 1; 0 and 2 elsewhere
    expert_map = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    sorted_ids, expert_ids, total = align_buffers(6, 4, 2)
    scatter_idx = torch.empty(6, 1, dtype=torch.int32)
    s.moe_align_block_size(topk_ids, 4, 2, sorted_ids, expert_ids, total, expert_map, scatter_idx)
    assert total.tolist() == [4]
    assert sorted_ids[:4].tolist() == [2, 5, 0, 6] and set(sorted_ids[4:].tolist()) == {6}
    assert expert_ids.tolist()[:3] == [0, 1, -1]
    assert scatter_idx.reshape(-1).tolist() == [0, -1, 2, -1, -1, 5]


def test_moe_sum_sums_the_top_k_in_fp32_and_skips_the_unrouted_slots_when_told() -> None:
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = torch.empty(5, 16, dtype=torch.bfloat16)
    s.moe_sum(x, out)
    assert torch.equal(out, x.float().sum(1).bfloat16())
    poisoned = x.clone()
    poisoned[1, 2] = float("nan")  # a slot no GEMM wrote
    poisoned[3, 0] = float("nan")  # a slot of an expert off this rank
    topk_ids = torch.tensor([[0, 1, 2], [0, 1, -1], [2, 2, 0], [3, 1, 0], [1, 0, 2]], dtype=torch.int32)
    s.moe_sum(poisoned, out, topk_ids, torch.tensor([0, 1, 2, -1], dtype=torch.int32))
    kept = torch.ones(5, 3, 1)
    kept[1, 2] = kept[3, 0] = 0.0
    assert torch.equal(out, (x.float() * kept).sum(1).bfloat16())


# ---- no host syncs, no shapes by value --------------------------------------------------

FORBIDDEN_FUNCTIONS = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "numpy"}
FORBIDDEN_ATEN = {
    "aten._local_scalar_dense",  # what .item(), int(t), bool(t) become
    "aten.nonzero",
    "aten.masked_select",
    "aten.bincount",  # reads the max on the host
    "aten.repeat_interleave",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.item",
}


class Recorder(TorchFunctionMode):
    """Fails on a Python-level host read; collects every tensor function called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", str(func))
        assert name not in FORBIDDEN_FUNCTIONS, f"host sync: Tensor.{name}"
        self.calls.append(name)
        return func(*args, **(kwargs or {}))


class AtenRecorder(TorchDispatchMode):
    """Fails on an aten op that syncs or sizes its output by value (boolean indexing
    included); keeps each op with its output shapes."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.trace: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(
        self, func: torch._ops.OpOverload, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        name = str(func.overloadpacket)
        assert name not in FORBIDDEN_ATEN, f"host sync or data-dependent shape: {func}"
        if name in ("aten.index", "aten.index_put", "aten._index_put_impl"):
            indices = args[1] if len(args) > 1 else ()
            assert not any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices), (
                f"boolean indexing: {func}"
            )
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.trace.append((name, [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]))
        return out


def calls(seed: int) -> list[tuple[Callable[..., None], tuple[Any, ...]]]:
    """One call of each op, with buffers as vLLM allocates them; same shapes for any seed."""
    g = torch.Generator().manual_seed(seed)
    t, e, k = 11, 8, 2
    logits = torch.randn(t, e, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    ids[seed % t, 0] = -1  # a padding token, somewhere different each time
    expert_map = torch.randperm(e, generator=g).int() - 2  # a varying pair of experts off this rank
    expert_map = torch.where(expert_map < 0, -1, expert_map).int()
    outs = (torch.empty(t, k), torch.empty(t, k, dtype=torch.int32), torch.empty(t, k, dtype=torch.int32))
    is_padding = torch.rand(t, generator=g) < 0.3
    return [
        (s.topk_softmax, (*outs, logits, True, torch.randn(e, generator=g), is_padding)),
        (s.moe_align_block_size, (ids, e, 16, *align_buffers(t * k, e, 16), None, None)),
        (
            s.moe_align_block_size,
            (ids, e, 4, *align_buffers(t * k, e, 4), expert_map, torch.empty(t * k, 1, dtype=torch.int32)),
        ),
        (s.moe_sum, (torch.randn(t, k, 16, generator=g), torch.empty(t, 16), ids, expert_map)),
    ]


def traced(fn: Callable[..., None], args: tuple[Any, ...]) -> list[tuple[str, list[tuple[int, ...]]]]:
    functions, aten = Recorder(), AtenRecorder()
    with functions, aten:
        fn(*args)
    assert functions.calls and aten.trace
    return aten.trace


def test_no_op_syncs_with_the_host_or_shapes_anything_by_value() -> None:
    for i, ((fn, a), (_, b)) in enumerate(zip(calls(0), calls(5), strict=True)):
        # different values, same shapes: the same ops, making the same shapes
        assert traced(fn, a) == traced(fn, b), (i, fn.__name__)


@pytest.mark.parametrize(
    "host_read",
    [
        lambda x: x.sum().item(),
        lambda x: x.tolist(),
        lambda x: x.nonzero(),
        lambda x: x[x > 0],
        lambda x: bool(x.sum() > 0),
        lambda x: torch.bincount(x.long().abs()),
    ],
)
def test_the_sync_detector_catches_each_kind_of_host_read(host_read: Callable[[torch.Tensor], Any]) -> None:
    with pytest.raises(AssertionError, match=r"host sync|boolean indexing|data-dependent"):
        traced(host_read, (torch.randn(6),))


# ---- the ops as torch.ops._moe_C, in a process of their own -----------------------------

REGISTRATION_CHECK = r"""
import json
import torch
from scripts.gpu import stand_in_moe as s

g = torch.Generator().manual_seed(0)
logits = torch.randn(6, 8, generator=g)
w, i, src = torch.empty(6, 2), torch.empty(6, 2, dtype=torch.int32), torch.empty(6, 2, dtype=torch.int32)
torch.ops._moe_C.topk_softmax(w, i, src, logits, True, None, None)
top = torch.topk(torch.softmax(logits, -1), 2)
ok = {"topk_softmax": torch.equal(i.long(), top.indices)
      and torch.allclose(w, top.values / top.values.sum(-1, keepdim=True))}
sid, eid = torch.empty(12 + 8 * 3, dtype=torch.int32), torch.empty(9, dtype=torch.int32)
n = torch.empty(1, dtype=torch.int32)
torch.ops._moe_C.moe_align_block_size(i, 8, 4, sid, eid, n, None, None)
routed = sorted(x for x in sid.tolist() if x < 12)
ok["moe_align_block_size"] = int(n[0]) % 4 == 0 and routed == list(range(12))
x, out = torch.randn(6, 2, 16, generator=g), torch.empty(6, 16)
torch.ops._moe_C.moe_sum(x, out, None, None)
ok["moe_sum"] = torch.allclose(out, x.sum(1))
m = torch.device("meta")
torch.ops._moe_C.moe_sum(x.to(m), out.to(m))
torch.ops._moe_C.moe_align_block_size(i.to(m), 8, 4, sid.to(m), eid.to(m), n.to(m), None, None)
torch.ops._moe_C.topk_softmax(w.to(m), i.to(m), src.to(m), logits.to(m), False, None, None)
schemas = {
    name: [a.name for a in getattr(torch.ops._moe_C, name).default._schema.arguments] for name in s.DEFINED
}
print(json.dumps({"defined": s.DEFINED, "failed": s.FAILED, "ok": ok, "schemas": schemas}))
"""


@pytest.fixture(scope="module")
def registered() -> dict[str, Any]:
    # a process of its own: the ops go into torch's global _moe_C namespace
    proc = subprocess.run(
        [sys.executable, "-c", REGISTRATION_CHECK],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_torch_ops_moe_c_holds_the_three_ops_and_computes_them_on_cpu(registered: dict[str, Any]) -> None:
    assert registered["failed"] == {}
    assert sorted(registered["defined"]) == ["moe_align_block_size", "moe_sum", "topk_softmax"]
    assert all(registered["ok"].values()), registered["ok"]


def passed_by_vllm_033() -> dict[str, int]:
    """How many positional arguments each ``torch.ops._moe_C.<op>(...)`` call in vLLM
    0.33's ``_custom_ops.py`` passes (the most, over its calls)."""
    counts: dict[str, int] = {}
    for node in ast.walk(ast.parse(CUSTOM_OPS_033.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Attribute) and owner.attr == "_moe_C":
            counts[node.func.attr] = max(counts.get(node.func.attr, 0), len(node.args))
    return counts


@pytest.mark.skipif(not CUSTOM_OPS_033.is_file(), reason="vLLM 0.33's tree is not unpacked here")
def test_each_schema_takes_every_argument_vllm_033_passes_in_its_order(registered: dict[str, Any]) -> None:
    passed = passed_by_vllm_033()
    for name, arguments in registered["schemas"].items():
        assert len(arguments) == passed[name], (name, arguments)
    assert registered["schemas"]["topk_softmax"][4:] == ["renormalize", "bias", "is_padding"]
    assert registered["schemas"]["moe_align_block_size"][6:] == ["maybe_expert_map", "scatter_idx"]
    assert registered["schemas"]["moe_sum"] == ["input", "output", "topk_ids", "expert_map"]
