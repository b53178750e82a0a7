"""A real producer in pull mode: vLLM (CPU build, in-process engine) with
extract_hidden_states and HiddenStatesConnector, ``"delivery": "pull"``. Runs generate()
on the prompts of its JSON spec (if it has any), prints one JSON line with each prompt's
kv_transfer_params and generated token ids, then serves its samples while answering
commands on stdin, one a line: "generate RUN" (generate() on the JSON run's ``prompts``,
``max_tokens`` and ``kv_params``, answered as the first), "step" (a few engine steps, which
report released and expired samples to vLLM; prints vLLM's KV cache usage and the requests
it still holds), "overwrite VICTIM TOKEN DONOR" (the last run's prompt VICTIM's token TOKEN
gets prompt DONOR's first row in vLLM's cache, no engine step taken; prints "overwritten")
and "quit"."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def overwrite(llm: Any, sched: Any, request_ids: list[str], victim: int, token: int, donor: int) -> None:
    """Prompt ``victim``'s token ``token`` gets prompt ``donor``'s first row, every captured
    layer, in vLLM's own cache-only layer (its view [block, layer, token, hidden]), as a
    late write of another request would: the blocks found through vLLM's KV cache manager."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

    from kv_connector.producer.scheduler_side import hidden_state_group

    g = hidden_state_group(sched.kv_cache_config)
    victim_blocks = sched.kv_cache_manager.get_block_ids(request_ids[victim])[g]
    donor_blocks = sched.kv_cache_manager.get_block_ids(request_ids[donor])[g]

    def write(worker: Any) -> None:
        (layer,) = get_layers_from_vllm_config(worker.vllm_config, CacheOnlyAttentionLayer).values()
        kv = layer.kv_cache
        cache = kv[0] if isinstance(kv, (list, tuple)) else kv
        bs = cache.shape[2]
        cache[victim_blocks[token // bs], :, token % bs] = cache[donor_blocks[0], :, 0]

    llm.collective_rpc(write)


def generate(llm: Any, run: dict[str, Any]) -> list[str]:
    """generate() on ``run``'s prompts (``max_tokens`` and ``kv_params`` per prompt); prints
    each output's kv_transfer_params and generated tokens as one JSON line; returns the
    engine's request ids (vLLM adds a suffix to the caller's), as the handles name them."""
    from vllm import SamplingParams

    from kv_connector.wire.handle import decode_handle

    prompts = [{"prompt_token_ids": p} for p in run["prompts"]]
    kv_params = run.get("kv_params") or [None] * len(prompts)
    params = [
        SamplingParams(
            max_tokens=m,
            temperature=0.0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": kv} if kv else None,
        )
        for m, kv in zip(run["max_tokens"], kv_params, strict=True)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    print(
        json.dumps(
            {
                "outputs": [o.kv_transfer_params for o in outs],
                "generated": [list(o.outputs[0].token_ids) for o in outs],
            }
        ),
        flush=True,
    )
    return [
        decode_handle(h).request_id if (h := (o.kv_transfer_params or {}).get("handle")) else o.request_id
        for o in outs
    ]


def main() -> int:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=spec.get("max_model_len", 2048),
        max_num_batched_tokens=2048,
        max_num_seqs=spec.get("max_num_seqs", 16),
        enable_prefix_caching=False,
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 128 << 20),
        enforce_eager=True,
        block_size=spec.get("block_size"),
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": spec["layer_ids"]}},
        },
        kv_transfer_config={
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"delivery": "pull", **spec.get("extra", {})},
        },
    )
    sched = llm.llm_engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
    request_ids = generate(llm, spec) if spec.get("prompts") else []
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        if line.startswith("generate "):
            request_ids = generate(llm, json.loads(line[len("generate ") :]))
            continue
        if line.startswith("overwrite "):
            victim, token, donor = (int(x) for x in line.split()[1:])
            overwrite(llm, sched, request_ids, victim, token, donor)
            print(json.dumps("overwritten"), flush=True)
            continue
        for _ in range(3):
            llm.llm_engine.step()
            time.sleep(0.02)
        state = {"kv_usage": sched.kv_cache_manager.usage, "held": sorted(sched.requests)}
        print(json.dumps(state), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
