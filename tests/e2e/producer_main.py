"""A real producer: vLLM (CPU build) with extract_hidden_states and HiddenStatesConnector,
in its own process.

One run: ``producer_main.py SPEC`` builds the engine from the JSON spec, runs generate() on
its prompts, prints one JSON line with each prompt's request id and kv_transfer_params, and
exits without stepping again.

Serving: ``producer_main.py --serve ENGINE`` builds the engine once, prints ``READY_MARK``,
then takes one JSON run a line on stdin (the spec's prompts and sampling keys) and answers
each with a line ``RESULT_MARK`` + its JSON result, until stdin closes: the engine the tests
of one configuration share (``tests.engines``)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

READY_MARK = "@@producer-ready"
RESULT_MARK = "@@producer-result "


def build(spec: dict[str, Any]) -> Any:
    """The engine the spec describes (an ``LLM``)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if spec.get("inprocess", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    if spec.get("faults"):  # faults in what vLLM computes, for the tests of the checks that see them
        from tests.e2e.state_faults import install

        install({int(k): v for k, v in spec["faults"].items()})

    extra = {"consumer_address": spec["address"], **spec.get("extra", {})}
    # what a test pins of vLLM's configuration; the rest is vLLM's choice for this host
    pinned = {k: spec[k] for k in ("block_size", "mamba_ssm_cache_dtype") if spec.get(k) is not None}
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 2048),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
        max_num_seqs=spec.get("max_num_seqs", 16),
        enable_prefix_caching=spec.get("enable_prefix_caching", False),
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 128 << 20),
        tensor_parallel_size=spec.get("tp", 1),
        pipeline_parallel_size=spec.get("pp", 1),
        enforce_eager=True,
        **pinned,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": spec["layer_ids"]}},
        },
        kv_transfer_config={
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": spec.get("kv_role", "kv_producer"),
            "kv_connector_extra_config": extra,
        },
    )


def run(llm: Any, spec: dict[str, Any], inprocess: bool) -> dict[str, Any]:
    """generate() on the spec's prompts; the JSON result (each output's request id,
    kv_transfer_params, tokens, prompt logprobs; the in-process scheduler's state after
    ``drain_steps`` more steps)."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def kv_params(i: int) -> dict[str, object] | None:
        """Prompt i's kv_transfer_params: the spec's ``kv_params[i]`` (sample_id, metadata),
        plus include_output_tokens for the prompts in ``with_output``."""
        given = spec.get("kv_params") or [None] * len(prompts)
        out = dict(given[i] or {})
        if i in spec.get("with_output", []):
            out["include_output_tokens"] = True
        return out or None

    params = [
        SamplingParams(
            max_tokens=m,
            temperature=0.0,
            ignore_eos=True,
            prompt_logprobs=spec.get("prompt_logprobs"),
            detokenize=False,  # no tokenizer (skip_tokenizer_init): nothing to detokenize
            extra_args={"kv_transfer_params": kv} if (kv := kv_params(i)) else None,
        )
        for i, m in enumerate(spec.get("max_tokens") or [1] * len(prompts))
    ]
    print("producer: generating", file=sys.stderr, flush=True)  # a marker for tests
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.monotonic() - t0
    result: dict[str, Any] = {
        "elapsed_s": elapsed,
        "outputs": [
            {
                "request_id": (o.kv_transfer_params or {}).get("hidden_states", {}).get("request_id"),
                "kv_transfer_params": o.kv_transfer_params,
                "output_token_ids": list(o.outputs[0].token_ids),
                "num_cached_tokens": o.num_cached_tokens,  # prefix-cache hits
                # with spec["prompt_logprobs"]: each prompt position's {token id: log-probability}
                "prompt_logprobs": [
                    None if p is None else {str(t): lp.logprob for t, lp in p.items()}
                    for p in (o.prompt_logprobs or [])
                ],
            }
            for o in outs
        ],
    }
    if inprocess:
        # the in-process engine's scheduler: every block back in the pool?
        for _ in range(int(spec.get("drain_steps", 0))):
            llm.llm_engine.step()
            time.sleep(0.05)
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        result["kv_usage"] = sched.kv_cache_manager.usage
        result["held_requests"] = sorted(sched.requests)
    return result


def serve(spec: dict[str, Any]) -> int:
    llm = build(spec)
    print(READY_MARK, flush=True)
    for line in sys.stdin:
        if line.strip():
            result = run(llm, json.loads(line), spec.get("inprocess", True))
            print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


def main() -> int:
    if sys.argv[1] == "--serve":
        return serve(json.loads(sys.argv[2]))
    spec = json.loads(sys.argv[1])
    llm = build(spec)
    result = run(llm, spec, spec.get("inprocess", True))
    print(json.dumps(result), flush=True)
    if spec.get("linger_s"):
        time.sleep(spec["linger_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
