"""The main job on a tiny local model: a reader, a producer vLLM with extract_hidden_states
and HiddenStatesConnector, a few hundred prompts, and one sample checked against
transformers. The reader's progress line runs meanwhile (as in the reader CLI) and its
Prometheus endpoint is scraped at the end.

    python -m scripts.demo [--prompts 300] [--out DIR]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scripts.support.stopping import raise_on_termination

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

LAYER_IDS = [1, 2, 4]
# how long vLLM's engine may take to exit before it is killed; vLLM's own default grace is
# short enough for a busy host to run past it, and a killed engine warns
SHUTDOWN_GRACE_S = 60.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--out", default="demo-out", help="where the tiny model is built")
    args = ap.parse_args()
    raise_on_termination()  # SIGTERM/SIGHUP unwind like Ctrl-C: vLLM's engine stops with the demo

    import torch

    from kv_connector.datagen.httpclient import Server
    from kv_connector.files.console import ProgressPrinter, reading_of
    from kv_connector.reader import HiddenStatesReader, Sample
    from scripts.support.make_tiny_model import build_tiny_model

    model = build_tiny_model(Path(args.out) / "tiny-llama", "llama", seed=0)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 1024) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.prompts)
    ]
    total_tokens = sum(map(len, prompts))

    reader = HiddenStatesReader(pool_bytes=64 << 20, metrics_address="127.0.0.1:0")
    assert reader.metrics is not None
    print(f"reader listening on {reader.address}, metrics on {reader.metrics.url}")
    progress = ProgressPrinter(
        lambda: reading_of(reader),
        stream=sys.stdout,
        interval_s=None,
        emit=lambda line: print(line, flush=True),
    ).start()
    received: list[Sample] = []
    nbytes = 0
    done = threading.Event()
    t_last = [0.0]

    def consume() -> None:
        nonlocal nbytes
        for s in reader.samples(len(prompts), timeout=600):
            if not received:
                received.append(s.keep())  # keep one for the check below (its lease holds a few pages)
            else:
                # keep only what the summary needs; the sample itself (a view of the pool on
                # lease) goes, and its pages with it
                received.append(Sample(s.request_id, s.token_ids, s.hidden_states.new_empty(0), s.layer_ids))
            nbytes += s.hidden_states.numel() * s.hidden_states.element_size()
            t_last[0] = time.monotonic()
        done.set()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    quiet_chat_template_warmup()

    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory_bytes=256 << 20,
        enforce_eager=True,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS}},
        },
        kv_transfer_config={
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"consumer_address": reader.address},
        },
    )
    t0 = time.monotonic()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False
    )
    t_gen = time.monotonic() - t0
    if not done.wait(timeout=600):
        raise SystemExit(f"only {len(received)} of {len(prompts)} samples arrived")
    progress.close()
    results = [progress.progress.summary(reader.stats())]
    scraped = Server(f"http://{reader.metrics_address}").get_text("/metrics")
    results.append(f"scrape of {reader.metrics.url} (excerpt):")
    results += [
        "  " + line
        for line in scraped.splitlines()
        if line.startswith("hidden_states_reader_") and "_bucket" not in line and "_created" not in line
    ]
    elapsed = t_last[0] - t0
    ids = {o.kv_transfer_params["hidden_states"]["request_id"] for o in outs if o.kv_transfer_params}
    got = {s.request_id for s in received}
    results += [
        f"samples received: {len(received)} of {len(prompts)} (each exactly once: {got == ids})",
        f"prompt tokens: {total_tokens} in {elapsed:.2f} s (generate() returned after {t_gen:.2f} s)",
        f"tokens/s: {total_tokens / elapsed:,.0f}",
        f"bytes/s: {nbytes / elapsed / 1e6:,.1f} MB/s ({nbytes / 1e6:.1f} MB of hidden states)",
    ]
    shut_down(llm)
    reader.close()

    from transformers import AutoModelForCausalLM

    first = received[0]
    ref_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    last: list[torch.Tensor] = []
    hook = ref_model.model.layers[-1].register_forward_hook(
        lambda m, a, o: last.append(o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        hs = ref_model(first.token_ids[None], output_hidden_states=True).hidden_states
    hook.remove()
    n_layers = ref_model.config.num_hidden_layers
    ref = torch.stack([last[0][0] if k == n_layers else hs[k][0] for k in LAYER_IDS], dim=1)
    err = float((first.hidden_states - ref).norm() / ref.norm())
    results.append(
        f"check of {first.request_id} ({first.token_ids.numel()} tokens) against transformers: "
        f"relative error {err:.2e} ({'ok' if err < 1e-4 else 'MISMATCH'})"
    )
    print("\n".join(["", "results:", *results]), flush=True)
    if err >= 1e-4 or got != ids:
        raise SystemExit(1)


class _NoChatTemplateWarmup(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" warning and its traceback where the failure
    is the missing tokenizer: the tiny model has none (``skip_tokenizer_init``), its prompts
    are token ids, and no chat template is ever rendered."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Chat template warmup failed"):
            return True
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, ValueError) and "skip_tokenizer_init" in str(error))


def quiet_chat_template_warmup() -> None:
    """vLLM's ``LLM`` warms its chat template up at start, which cannot work without a
    tokenizer: its warning (a traceback a newcomer reads as a failure) is dropped."""
    logging.getLogger("vllm.renderers.base").addFilter(_NoChatTemplateWarmup())


def shut_down(llm: Any) -> None:
    """Stop vLLM's engine before the reader closes, its own shutdown notes silenced.

    The producer closes its connections first, so the reader's close is not taken for a
    lost reader (a retry warning) and the engine does not die at interpreter exit.
    """
    logging.getLogger("vllm").setLevel(logging.WARNING)
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)


if __name__ == "__main__":
    main()
