"""What the connector costs the producer, on a tiny model, prefill only:

  a:  vLLM with extract_hidden_states + HiddenStatesConnector + a reader in the bench's
      process taking every sample (timed until the last sample is taken);
  a0: vLLM with extract_hidden_states and no connector (what extraction costs vLLM
      itself: a/a0 is the connector's own overhead);
  c:  the same vLLM without extraction and without a connector;
  ar: vLLM with extract_hidden_states and ``raw_connector``'s connector, which only WRITEs
      each prompt's blocks by NIXL into a raw target in the bench's process (timed until
      the last notification arrived).

a0 over c, paired too, is vLLM's own cost of extraction: the most a over c can be with a
connector that costs nothing (the ceiling of ``a_over_c`` on this machine). ar over a0 is
the most a over a0 can be for any connector that moves the states out of the engine's
process by NIXL on this machine (the ceiling of ``a_over_a0``).

Each arm is one long-lived producer process (the in-process engine, built once, a warm-up
batch run) that runs a batch each time it is told to; the ratios come from alternating
pairs (``scripts.bench.paired``). A round is 96 new prompts of 1024 random tokens, so that
every token is computed, as a data-generation run's distinct conversations are. The same
batch run again is reported as ``a_over_a0_prefix_cached``: from its second round vLLM's
prefix cache serves 896 of each prompt's 1024 tokens while the connector still ships them
all. Each round reports generate()'s own time, the tail, and the producer process's CPU
seconds (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from scripts.bench.paired import Run, cpu_seconds, run_pairs
from scripts.bench.raw_target import RawTarget, start_taking

LAYER_IDS = [1, 2, 4]


def _producer(spec: dict[str, Any]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if spec["extract"]:
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS}},
        }
    if spec["raw_target"]:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "RawShipConnector",
            "kv_connector_module_path": "scripts.bench.raw_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"raw_target": spec["raw_target"]},
        }
    elif spec["connector"]:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"consumer_address": spec["address"]},
        }
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=4096,
        max_num_batched_tokens=spec["batch_tokens"],
        kv_cache_memory_bytes=512 << 20,
        enforce_eager=True,
        **kwargs,
    )
    params = SamplingParams(max_tokens=1)
    warm = [TokensPrompt(prompt_token_ids=p) for p in spec["warmup"]]
    llm.generate(warm, params, use_tqdm=False)
    repeated = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        word = line.split()
        if not word or word[0] != "go":
            break
        # "go SEED": a batch of new prompts, none of whose blocks vLLM's prefix cache holds;
        # "go": the batch of the spec again (most of its blocks cached from the last time)
        prompts = repeated if len(word) == 1 else fresh_prompts(int(word[1]), len(repeated), spec["length"])
        c0, t0 = cpu_seconds(), time.time()
        llm.generate(prompts, params, use_tqdm=False)
        t1 = time.time()
        print(json.dumps({"t0": t0, "t1": t1, "cpu_s": cpu_seconds() - c0}), flush=True)


def fresh_prompts(seed: int, n: int, length: int) -> list[Any]:
    """``n`` prompts of ``length`` random token ids, drawn from ``seed``."""
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(1, 1024) for _ in range(length)]) for _ in range(n)]


class ModelArm:
    """One producer process, built once; ``round()`` runs a batch through it (new prompts,
    or the spec's again) and waits for its samples (ours: the reader's; ar: the target's)."""

    def __init__(
        self,
        name: str,
        model: Path,
        prompts: list[list[int]],
        warmup: list[list[int]],
        extract: bool,
        batch_tokens: int,
        connector: bool,
        seed: int = 1,
        raw: bool = False,
    ) -> None:
        """``connector``: ours, into a reader in this process; ``raw``: the raw arm's
        (``raw_connector``), into a raw target here."""
        from kv_connector.reader import HiddenStatesReader

        self.name = name
        self.tokens = float(sum(map(len, prompts)))
        self.n_prompts = len(prompts)
        self.reader = HiddenStatesReader(pool_bytes=256 << 20) if connector else None
        self.work = Path(tempfile.mkdtemp(prefix=f"hs-bench-{name}-"))
        self.target = RawTarget(self.work / "target.json", 256 << 20) if raw else None
        spec = {
            "model": str(model),
            "prompts": prompts,
            "warmup": warmup,
            "extract": extract,
            "connector": connector,
            "batch_tokens": batch_tokens,
            "length": len(prompts[0]),
            "address": self.reader.address if self.reader else "",
            "raw_target": str(self.target.path) if self.target else "",
        }
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        self.spec_path = f.name
        self.log: IO[str] = tempfile.NamedTemporaryFile("w+", suffix=f"-{name}.log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.bench.model", "--producer", f.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self._started = False
        self._seed = seed  # the next fresh batch's (``round``)
        if self.reader is not None or self.target is not None:  # the warm-up batch's samples
            self._consume(len(warmup))

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                got: dict[str, Any] = json.loads(line)
                return got
        self.log.seek(0)
        raise RuntimeError(f"producer {self.name} ended:\n{self.log.read()[-4000:]}")

    def _consume(self, n: int) -> list[float]:
        times: list[float] = []
        if self.target is not None:
            self._taker = start_taking(self.target, n, times)
            return times
        assert self.reader is not None

        def take() -> None:
            assert self.reader is not None
            for _ in self.reader.samples(n, timeout=600):
                times.append(time.time())

        th = threading.Thread(target=take, daemon=True)
        th.start()
        self._taker = th
        return times

    def ready(self) -> ModelArm:
        if not self._started:
            self._line()
            if self.reader is not None or self.target is not None:
                self._taker.join(600)
            self._started = True
        return self

    def round(self, fresh: bool = True) -> Run:
        """One batch through the engine: new prompts (``fresh``: every token computed, as a
        data-generation run's distinct conversations are), or the spec's batch again (its
        blocks mostly served by vLLM's prefix cache: only the tail of each prompt computed)."""
        self.ready()
        taking = self.reader is not None or self.target is not None
        times = self._consume(self.n_prompts) if taking else []
        assert self.proc.stdin is not None
        self._seed += 1
        self.proc.stdin.write(f"go {self._seed}\n" if fresh else "go\n")
        self.proc.stdin.flush()
        res = self._line()
        end = res["t1"]
        if taking:
            self._taker.join(600)
            if len(times) != self.n_prompts:
                raise RuntimeError(f"reader got {len(times)} of {self.n_prompts} samples")
            end = max(end, times[-1])
        # generate()'s own time, and how long the last samples took to arrive after it
        detail = {"generate_s": res["t1"] - res["t0"], "tail_s": end - res["t1"]}
        # cpu_s: the producer process's CPU seconds in generate() (the engine and, in a, the
        # connector's threads; the reader's process is not counted)
        return Run(end - res["t0"], self.tokens, cpu_s=res["cpu_s"], detail=detail)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.reader is not None:
            self.reader.close()
        if self.target is not None:
            self.target.close()
        shutil.rmtree(self.work, ignore_errors=True)
        self.log.close()
        os.unlink(self.spec_path)


def _say(text: str) -> None:
    print(f"[bench_model {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main(n_prompts: int = 96, length: int = 1024, batch_tokens: int = 4096, pairs: int = 7) -> dict[str, Any]:
    from scripts.support.make_tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="hs-bench-model-"))
    model = build_tiny_model(work / "tiny-llama", "llama", seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1024) for _ in range(length)] for _ in range(n_prompts)]
    warmup = [[rng.randrange(1, 1024) for _ in range(length)] for _ in range(4)]
    arms = {
        "c": ModelArm("c", model, prompts, warmup, False, batch_tokens, False),
        "a0": ModelArm("a0", model, prompts, warmup, True, batch_tokens, False),
        "a": ModelArm("a", model, prompts, warmup, True, batch_tokens, True),
        "ar": ModelArm("ar", model, prompts, warmup, True, batch_tokens, False, raw=True),
    }
    try:
        for arm in arms.values():
            arm.ready()
        _say(f"producers ready; {pairs} pairs per ratio, {n_prompts} prompts of {length} tokens a round")
        a = arms["a"]
        over_c = run_pairs(a.round, arms["c"].round, pairs)
        _say(f"a vs c: {[round(x, 3) for x in over_c.ratio().values]}")
        over_a0 = run_pairs(a.round, arms["a0"].round, pairs)
        _say(f"a vs a0: {[round(x, 3) for x in over_a0.ratio().values]}")
        # the same batch each round: vLLM's prefix cache serves most of each prompt, the
        # connector still ships every token (reported beside a_over_a0)
        cached = run_pairs(lambda: a.round(fresh=False), lambda: arms["a0"].round(fresh=False), pairs)
        _say(f"a vs a0, prefix cached: {[round(x, 3) for x in cached.ratio().values]}")
        # vLLM's own cost of extraction, no connector: the most a_over_c can be
        a0_c = run_pairs(arms["a0"].round, arms["c"].round, pairs)
        _say(f"a0 vs c: {[round(x, 3) for x in a0_c.ratio().values]}")
        # a connector that only WRITEs each prompt's blocks: the most a_over_a0 can be
        ar, a0 = arms["ar"], arms["a0"]
        raw = run_pairs(ar.round, a0.round, pairs)
        _say(f"ar vs a0: {[round(x, 3) for x in raw.ratio().values]}")
        raw_cached = run_pairs(lambda: ar.round(fresh=False), lambda: a0.round(fresh=False), pairs)
        _say(f"ar vs a0, prefix cached: {[round(x, 3) for x in raw_cached.ratio().values]}")
    finally:
        for arm in arms.values():
            arm.close()
    return {
        "a_over_c": over_c.ratio(),
        "a_over_a0": over_a0.ratio(),
        "a_over_a0_prefix_cached": cached.ratio(),
        "a0_over_c": a0_c.ratio(),
        "raw_connector_over_a0": raw.ratio(),
        "raw_connector_over_a0_prefix_cached": raw_cached.ratio(),
        "a_tokens_per_s": over_c.each("a"),
        "c_tokens_per_s": over_c.each("b"),
        "a0_tokens_per_s": over_a0.each("b"),
        # where a's extra time goes: generate() itself, and the samples' arrival after it
        "a_generate_s": over_a0.each("a", lambda r: r.detail["generate_s"]),
        "a0_generate_s": over_a0.each("b", lambda r: r.detail["generate_s"]),
        "a_tail_s": over_a0.each("a", lambda r: r.detail["tail_s"]),
        "a_producer_cpu_s": over_a0.each("a", lambda r: r.cpu_s),
        "a0_producer_cpu_s": over_a0.each("b", lambda r: r.cpu_s),
        "a_prefix_cached_generate_s": cached.each("a", lambda r: r.detail["generate_s"]),
        "a0_prefix_cached_generate_s": cached.each("b", lambda r: r.detail["generate_s"]),
        "a_prefix_cached_tail_s": cached.each("a", lambda r: r.detail["tail_s"]),
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--producer":
        _producer(json.loads(Path(sys.argv[2]).read_text()))
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        out = main()
        print(json.dumps({k: v.rounded() for k, v in out.items()}, indent=1))
