"""vLLM producers for the tests: a typed spec per configuration, engines shared by every test
of that configuration, and a count of the engines the suite started.

A vLLM engine takes 15-60 s to start on two cores, far more than most tests' own work, so
the tests of one configuration share one running engine (``shared_producer``), as vLLM's own
tests share a ``RemoteOpenAIServer`` across a module. A shared engine serves runs over its
stdin (``tests/e2e/producer_main.py --serve``) into a reader that lives as long as it does.
Tests stay independent through their own prompts and request ids; a test that fails retires
the engines it used, so the next test of that configuration gets a fresh one. A test that
needs a fresh engine (start-up errors, kills, timing of a start) starts its own
(``run_producer``, ``start_producer``) and is counted as such.

    def test_x(llama_push: SharedProducer) -> None:
        got, result, log = llama_push.collect(Run(prompts=[[1, 2, 3]]), n=1)
"""

from __future__ import annotations

import collections
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import pytest

from scripts.support.deaths import explain, program_env
from tests.e2e.producer_main import READY_MARK, RESULT_MARK

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
PRODUCER_MAIN = REPO / "tests" / "e2e" / "producer_main.py"
FAILED = pytest.StashKey[bool]()  # in a test item's stash: one of its phases failed


def producer_main(*args: str) -> list[str]:
    """The command line of tests/e2e/producer_main.py with ``args``."""
    return [sys.executable, str(PRODUCER_MAIN), *args]


class Start(Enum):
    """How a test got its engine."""

    SHARED = "shared"  # started for a configuration, then reused by its tests
    FRESH = "fresh"  # started for one test (start-up errors, kills, timing)


class _Starts:
    """The engines the suite's tests started, by kind and how (printed at the run's end).

    ``test`` is the test running now (``tests/conftest.py`` sets it): a test that starts an
    engine of its own must say why with ``@pytest.mark.fresh_engine("why")``."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, Start]] = collections.Counter()
        self.reused = 0
        self.test: Any = None  # the pytest item running now, if any

    def count(self, kind: str, how: Start) -> None:
        unsaid = self.test is not None and self.test.get_closest_marker("fresh_engine") is None
        if how is Start.FRESH and unsaid:
            raise AssertionError(
                f"{self.test.nodeid} starts a {kind} of its own: use a shared engine (tests/engines.py) "
                'or say why with @pytest.mark.fresh_engine("why")'
            )
        self.counts[(kind, how)] += 1

    def dump(self) -> dict[str, Any]:
        """The counts as JSON-able data (an xdist worker's, for the controller)."""
        return {"counts": [[k, h.value, n] for (k, h), n in self.counts.items()], "reused": self.reused}

    def merge(self, dumped: dict[str, Any] | None) -> None:
        """Add another process's ``dump()``."""
        if dumped:
            for kind, how, n in dumped["counts"]:
                self.counts[(kind, Start(how))] += n
            self.reused += dumped["reused"]

    def report(self) -> list[str]:
        if not self.counts:
            return []
        total = sum(self.counts.values())
        lines = [
            f"vLLM engines started by the tests: {total}; tests that found theirs running: {self.reused}"
        ]
        for (kind, how), n in sorted(self.counts.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
            lines.append(f"  {kind}, {how.value}: {n}")
        return lines


STARTS = _Starts()


@dataclass(frozen=True)
class EngineSpec:
    """One producer engine's configuration: what ``LLM(...)`` gets, the connector's extra
    options, and the environment of its process. Hashable: it keys shared engines.

    ``layer_ids`` are vLLM's ``eagle_aux_hidden_state_layer_ids`` as given (unsorted ones
    stay so); None leaves a setting to vLLM (``EngineSpec.server``'s defaults); ``extra`` is
    ``kv_connector_extra_config`` less the reader's address, as sorted (key, JSON value) pairs
    (``EngineSpec.of`` builds it from a dict)."""

    model: str
    layer_ids: tuple[int, ...]
    dtype: str = "float32"
    block_size: int | None = 128
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = 2048
    max_num_seqs: int | None = 16
    enable_prefix_caching: bool | None = False
    kv_cache_memory_bytes: int = 128 << 20
    tp: int = 1
    pp: int = 1
    inprocess: bool = True
    kv_role: str = "kv_producer"
    mamba_ssm_cache_dtype: str | None = None
    extra: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    # faults injected into vLLM's forward (tests/e2e/state_faults.py): a prompt's first token -> fault
    faults: tuple[tuple[int, str], ...] = ()

    @classmethod
    def of(
        cls,
        model: Path | str,
        layer_ids: Sequence[int],
        extra: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        faults: Mapping[int, str] | None = None,
        **engine: Any,
    ) -> EngineSpec:
        return cls(
            model=str(model),
            layer_ids=tuple(layer_ids),
            extra=tuple(sorted((k, json.dumps(v)) for k, v in (extra or {}).items())),
            env=tuple(sorted((env or {}).items())),
            faults=tuple(sorted((faults or {}).items())),
            **engine,
        )

    @classmethod
    def server(
        cls, model: Path | str, layer_ids: Sequence[int], extra: Mapping[str, Any], **engine: Any
    ) -> EngineSpec:
        """An OpenAI server's spec: batch, sequences and prefix caching left to vLLM unless given."""
        defaults: dict[str, Any] = {
            "max_num_batched_tokens": None,
            "max_num_seqs": None,
            "enable_prefix_caching": None,
        }
        return cls.of(model, layer_ids, extra, **{**defaults, **engine})

    def extra_config(self) -> dict[str, Any]:
        """``kv_connector_extra_config`` less the reader's address."""
        return {k: json.loads(v) for k, v in self.extra}

    def as_cli_args(self) -> list[str]:
        """``vllm serve`` flags beyond what ``scripts.support.vllm_server`` passes itself
        (model, dtype, max model length, KV cache bytes, layers, connector)."""
        args: list[str] = []
        for flag, value in (
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-num-seqs", self.max_num_seqs),
            ("--block-size", self.block_size),
        ):
            if value is not None:
                args += [flag, str(value)]
        if self.tp != 1:
            args += ["--tensor-parallel-size", str(self.tp)]
        if self.pp != 1:
            args += ["--pipeline-parallel-size", str(self.pp)]
        if self.enable_prefix_caching is not None:
            args.append(
                "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching"
            )
        return args

    def as_spec(self, address: str) -> dict[str, Any]:
        """producer_main.py's JSON spec of this engine, shipping to ``address``."""
        return {
            "model": self.model,
            "address": address,
            "layer_ids": list(self.layer_ids),
            "dtype": self.dtype,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": self.enable_prefix_caching,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "tp": self.tp,
            "pp": self.pp,
            "inprocess": self.inprocess,
            "kv_role": self.kv_role,
            "mamba_ssm_cache_dtype": self.mamba_ssm_cache_dtype,
            "extra": self.extra_config(),
            "faults": {str(token): fault for token, fault in self.faults},
        }


@dataclass(frozen=True)
class Run:
    """One generate() call on an engine: the prompts and their sampling.

    ``max_tokens`` per prompt (1 each when empty); ``kv_params`` per prompt (sample_id,
    metadata; None for none); ``with_output``: the prompts whose samples include their output
    tokens; ``prompt_logprobs``: vLLM's, for every prompt; ``drain_steps``: engine steps after
    generate() returned, before the scheduler's state is read (in-process engines)."""

    prompts: Sequence[Sequence[int]]
    max_tokens: Sequence[int] = ()
    kv_params: Sequence[Mapping[str, Any] | None] = ()
    with_output: Sequence[int] = ()
    prompt_logprobs: int | None = None
    drain_steps: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "prompts": [list(p) for p in self.prompts],
            "max_tokens": list(self.max_tokens),
            "kv_params": [None if k is None else dict(k) for k in self.kv_params],
            "with_output": list(self.with_output),
            "prompt_logprobs": self.prompt_logprobs,
            "drain_steps": self.drain_steps,
        }


@dataclass
class RunOutcome:
    """What one run on a shared engine gave: the samples by request id, producer_main's JSON
    result, and the engine's log (its start-up, then this run's lines)."""

    samples: dict[str, Any]
    result: dict[str, Any]
    log: str


@dataclass
class SharedProducer:
    """A producer engine serving runs over stdin, with the reader it ships to.

    ``collect`` runs prompts and takes their samples; ``reader`` is the reader (a
    ``HiddenStatesReader``) every run of this engine ships to."""

    spec: EngineSpec
    reader: Any
    proc: subprocess.Popen[str] = field(init=False)
    startup_log: list[str] = field(default_factory=list)
    _lines: queue.Queue[str | None] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        STARTS.count("producer", Start.SHARED)
        self.proc = subprocess.Popen(
            producer_main("--serve", json.dumps(self.spec.as_spec(self.reader.address))),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=program_env(dict(self.spec.env)),
            start_new_session=True,
        )
        threading.Thread(target=self._pump, name="producer-output", daemon=True).start()
        self.startup_log = self._until(lambda line: line.startswith(READY_MARK), timeout=600)[0]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _until(self, done: Any, timeout: float) -> tuple[list[str], str]:
        """Lines up to the one ``done`` accepts (that one apart); fails with the log when the
        process ends or ``timeout`` passes first."""
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"producer: no answer in {timeout:.0f} s\n{''.join(got)[-5000:]}"
                ) from None
            if line is None:
                self._lines.put(None)
                log = "".join(self.startup_log + got)
                why = explain(log, self.proc.wait(), "producer")
                raise AssertionError(f"producer ended (rc {self.proc.returncode}) {why}\n{log[-5000:]}")
            if done(line):
                return got, line
            got.append(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def collect(self, run: Run, n: int, timeout: float = 600) -> RunOutcome:
        """Run ``run``; take ``n`` samples (each once), then its result; no further sample
        may follow. Samples a failed earlier test left are taken out first."""
        from kv_connector.reader import Sample

        while True:  # what an earlier, failed test left behind
            try:
                self.reader.get(timeout=0)
            except TimeoutError:
                break
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(run.as_json()) + "\n")
        self.proc.stdin.flush()
        got: dict[str, Sample] = {}
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            try:
                s = self.reader.get(timeout=2, copy=True)  # kept for the checks: a copy
            except TimeoutError:
                if not self.alive():
                    break
                continue
            assert s.request_id not in got, f"{s.request_id} delivered twice"
            got[s.request_id] = s
        lines, last = self._until(
            lambda line: line.startswith(RESULT_MARK), timeout=max(1.0, deadline - time.monotonic())
        )
        result: dict[str, Any] = json.loads(last[len(RESULT_MARK) :])
        assert len(got) == n, (len(got), n, "".join(lines)[-5000:])
        try:
            extra = self.reader.get(timeout=1.0)
        except TimeoutError:
            pass
        else:
            raise AssertionError(f"unexpected extra sample {extra.request_id}")
        while True:  # what the engine logged while the last sample was checked
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            if line is None:
                self._lines.put(None)
                break
            lines.append(line)
        return RunOutcome(got, result, "".join(self.startup_log + lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.reader.close()


Key = tuple[EngineSpec, str]


class Engines:
    """The running shared engines, by spec: producers served over stdin (``get``) and
    OpenAI servers (``server``). An engine lives from the first test that asks for it to the
    last one collected that uses the same fixture (``last_user``, set at collection), and a
    test that fails retires the engines it used."""

    def __init__(self, last_user: dict[str, str]) -> None:
        self._running: dict[Key, SharedProducer | Any] = {}
        self._fixture_of: dict[Key, str] = {}
        self.used_by_test: list[Key] = []
        self.last_user = last_user  # fixture name -> node id of its last test

    def shared(self, key: Key, fixture: str, start: Callable[[], T]) -> T:
        """The running engine of ``key`` for ``fixture``; ``start()`` makes one (any object
        with ``alive()`` and ``stop()``) when there is none or the last one died."""
        have: T = self._take(key, fixture, start)
        return have

    def _take(self, key: Key, fixture: str, start: Callable[[], Any]) -> Any:
        have = self._running.get(key)
        if have is not None and not have.alive():
            _stop(have)
            have = None
        if have is None:
            have = start()
            self._running[key] = have
        else:
            STARTS.reused += 1
        self._fixture_of[key] = fixture
        self.used_by_test.append(key)
        return have

    def server(self, spec: EngineSpec, workdir: Path, fixture: str) -> Any:
        """The running OpenAI server of ``spec`` for ``fixture`` (a
        ``tests.e2e.api_server.ApiServer``, started in ``workdir`` when there is none or the
        last one died)."""
        from tests.e2e.api_server import ApiServer

        def start() -> Any:
            workdir.mkdir(parents=True, exist_ok=True)
            server = ApiServer(
                Path(spec.model),
                spec.extra_config(),
                spec.layer_ids,
                workdir,
                args=spec.as_cli_args(),
                env=dict(spec.env),
                start=Start.SHARED,
            )
            return server.__enter__()

        return self._take((spec, "openai server"), fixture, start)

    def get(self, spec: EngineSpec, fixture: str, reader_options: Any = None) -> SharedProducer:
        """The running producer of ``spec`` for ``fixture``, shipping to a reader made with
        ``reader_options`` (a ``ReaderConfig``, or None for the defaults); started when there is
        none or the last one died."""
        from kv_connector.reader import HiddenStatesReader

        def start() -> SharedProducer:
            reader = (
                HiddenStatesReader(reader_options) if reader_options is not None else HiddenStatesReader()
            )
            try:
                return SharedProducer(spec, reader)
            except BaseException:
                reader.close()
                raise

        have: SharedProducer = self._take((spec, repr(reader_options)), fixture, start)
        return have

    def retire_used(self) -> None:
        """The engines the current test used are stopped (it failed: their state is unknown)."""
        for key in self.used_by_test:
            if (p := self._running.pop(key, None)) is not None:
                _stop(p)
        self.used_by_test.clear()

    def test_done(self, nodeid: str) -> None:
        """After a test: the engines whose fixture no later test uses are stopped."""
        self.used_by_test.clear()
        for key, fixture in list(self._fixture_of.items()):
            if self.last_user.get(fixture) == nodeid and (p := self._running.pop(key, None)) is not None:
                _stop(p)

    def close(self) -> None:
        for p in self._running.values():
            _stop(p)
        self._running.clear()


def _stop(engine: Any) -> None:
    engine.stop()
