"""A producer process killed (SIGKILL) mid-stream: the reader keeps the samples that were
complete, discards the partial ones and gets their pool pages back, never yields a
corrupt or partial sample, and keeps serving the other producers meanwhile."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import time
from typing import Any

import pytest

from kv_connector.reader import HiddenStatesReader, Sample
from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
from kv_connector.wire.layout import BlockLayout
from tests.integration.common import (
    expected_states,
    finish_sender,
    layout_dict,
    make_cache,
    same_bytes,
    start_sender,
    token_ids,
)
from tests.integration.faulty_transport import watched_reader

pytestmark = pytest.mark.integration

# Large samples: blocks of 256 KiB, 16 blocks (4 MiB) a sample.
BIG = BlockLayout("LTH", 16, 4, 1024, "float32")
SMALL = BlockLayout("TLH", 16, 3, 64, "bfloat16")
PAGE = BIG.block_bytes
BIG_BLOCKS = 16
NUM_CACHE_BLOCKS = 128


def plan(
    tag: str, layout: BlockLayout, sizes: list[int], seed: int, cache_blocks: int
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "request_id": f"{tag}-{i}",
            "num_tokens": n,
            "block_ids": rng.sample(range(cache_blocks), -(-n // layout.block_size)),
        }
        for i, n in enumerate(sizes)
    ]


def spec(
    address: str, producer_id: str, layout: BlockLayout, samples: list[dict[str, Any]], seed: int, **kw: Any
) -> dict[str, Any]:
    return dict(
        address=address,
        producer_id=producer_id,
        layout=layout_dict(layout),
        num_cache_blocks=kw.pop("num_cache_blocks", NUM_CACHE_BLOCKS),
        seed=seed,
        samples=samples,
        timeout_s=90.0,
        **kw,
    )


class Checker:
    """Checks every sample the reader yields against the producer's cache, at once."""

    def __init__(self) -> None:
        self.expected: dict[tuple[str, str], tuple[BlockLayout, Any, dict[str, Any]]] = {}
        self.got: dict[str, list[str]] = {}

    def expect(
        self, producer_id: str, layout: BlockLayout, seed: int, samples: list[dict[str, Any]], blocks: int
    ) -> None:
        cache = make_cache(layout, blocks, seed)
        for s in samples:
            self.expected[(producer_id, s["request_id"])] = (layout, cache, s)

    def take(self, sample: Sample) -> None:
        key = (sample.producer_id, sample.request_id)
        assert key in self.expected, f"the reader yielded a sample nobody sent: {key}"
        assert sample.request_id not in self.got.get(sample.producer_id, []), f"{key} delivered twice"
        layout, cache, s = self.expected[key]
        n = s["num_tokens"]
        assert sample.token_ids.tolist() == token_ids(s["request_id"], n), f"{key}: token ids differ"
        assert sample.hidden_states.shape == (n, layout.num_layers, layout.hidden_size)
        want = expected_states(cache, layout, s["block_ids"], n)
        assert same_bytes(sample.hidden_states, want), f"{key}: a corrupt or partial sample was yielded"
        self.got.setdefault(sample.producer_id, []).append(sample.request_id)


def complete_keys(reader: HiddenStatesReader, producer_id: str) -> set[str]:
    """Samples of ``producer_id`` the reader holds complete, not yet taken (its own state)."""
    return {request_id for _producer, request_id in reader.ready_samples(producer_id)}


def assert_pool_idle(reader: HiddenStatesReader) -> None:
    """Nothing pending, every page free, nobody waiting (the reader's own accounting)."""
    deadline = time.monotonic() + 10
    while True:
        ps = reader.pool_state()
        if ps.num_pages and ps.free == ps.num_pages and ps.waiting == 0:
            return
        assert time.monotonic() < deadline, f"pages did not come back: {ps}"
        time.sleep(0.05)


def whole_pool_producer(reader: HiddenStatesReader, checker: Checker, num_pages: int) -> None:
    """A fresh producer ships one sample that needs every page of the pool."""
    samples = plan("whole", BIG, [num_pages * BIG.block_size], seed=33, cache_blocks=NUM_CACHE_BLOCKS)
    checker.expect("whole", BIG, 33, samples, NUM_CACHE_BLOCKS)
    proc = start_sender(spec(reader.address, "whole", BIG, samples, 33))
    try:
        checker.take(reader.get(timeout=60))
        res = finish_sender(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert res["rc"] == 0 and res["finished"] == [samples[0]["request_id"]], res["stderr"][-3000:]


def kill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_a_producer_killed_mid_stream_leaves_complete_samples_and_returns_its_pages() -> None:
    num_pages = 3 * BIG_BLOCKS + 4  # three large samples at a time, and a little room
    victim = plan("victim", BIG, [BIG_BLOCKS * BIG.block_size] * 8, seed=31, cache_blocks=NUM_CACHE_BLOCKS)
    bystander = plan(
        "bystander", SMALL, [random.Random(i).randint(1, 40) for i in range(12)], seed=32, cache_blocks=64
    )
    checker = Checker()
    checker.expect("victim", BIG, 31, victim, NUM_CACHE_BLOCKS)
    checker.expect("bystander", SMALL, 32, bystander, 64)
    procs: list[subprocess.Popen[str]] = []
    with HiddenStatesReader(pool_bytes=num_pages * PAGE, page_bytes=PAGE) as reader:
        try:
            p = start_sender(spec(reader.address, "victim", BIG, victim, 31))
            procs.append(p)
            q = start_sender(spec(reader.address, "bystander", SMALL, bystander, 32, num_cache_blocks=64))
            procs.append(q)
            # Take two of the victim's samples (and whatever the bystander sends meanwhile).
            while len(checker.got.get("victim", [])) < 2:
                checker.take(reader.get(timeout=60))
            complete_at_kill = complete_keys(reader, "victim")
            kill(p)
            taken_before = list(checker.got["victim"])
            # Drain: the bystander's samples and the victim's complete ones, nothing else.
            deadline = time.monotonic() + 120
            while True:
                assert time.monotonic() < deadline, "the bystander never finished"
                try:
                    checker.take(reader.get(timeout=2))
                except TimeoutError:
                    if q.poll() is not None:
                        break
            res_q = finish_sender(q)
            assert res_q["rc"] == 0 and not res_q["failed"], res_q["stderr"][-3000:]
            assert sorted(checker.got["bystander"]) == sorted(s["request_id"] for s in bystander)
            got_victim = checker.got["victim"]
            after = set(got_victim) - set(taken_before)
            assert complete_at_kill <= after, (
                f"complete samples {sorted(complete_at_kill - after)} were lost when their producer died"
            )
            # The pool holds three samples at a time: at least three of the eight were
            # still waiting or being written when the producer died, and none of those came.
            assert 2 <= len(got_victim) <= 5, got_victim
            assert_pool_idle(reader)
            whole_pool_producer(reader, checker, num_pages)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()


def test_a_sample_with_a_killed_ranks_share_unwritten_is_never_yielded() -> None:
    """TP=2: rank 1 (in this process) ships only sample A, rank 0 (a subprocess) ships A, B
    and C, so B and C hold rank 0's half in their pages and wait for rank 1's forever.
    Rank 0 is killed, rank 1 leaves: B and C are discarded, their pages return."""
    layout, blocks, cache_blocks = BIG, 4, 32
    samples = plan("tp", layout, [blocks * layout.block_size] * 3, seed=34, cache_blocks=cache_blocks)
    num_pages = 3 * blocks + 2
    checker = Checker()
    checker.expect("tp", layout, 34, samples, cache_blocks)
    cache = make_cache(layout, cache_blocks, 34)  # ranks hold the same (replicated) states
    reader, watch = watched_reader(pool_bytes=num_pages * PAGE, page_bytes=PAGE)
    with reader:
        rank1 = HiddenStatesSender(
            SenderConfig(reader.address, "tp", rank=1, world_size=2, connect_timeout_s=30),
            cache,
            layout,
            list(range(layout.num_layers)),
        )
        rank0: subprocess.Popen[str] | None = None
        try:
            a = samples[0]
            rank1.ship(a["request_id"], token_ids(a["request_id"], a["num_tokens"]), a["block_ids"])
            rank0 = start_sender(
                spec(
                    reader.address,
                    "tp",
                    layout,
                    samples,
                    34,
                    rank=0,
                    world_size=2,
                    num_cache_blocks=cache_blocks,
                )
            )
            checker.take(reader.get(timeout=60))
            assert checker.got["tp"] == [a["request_id"]]
            # Wait until B and C hold rank 0's half: the reader's transport took the
            # notifications of rank 0's WRITEs into their pages, and was polled again since
            # (the serving thread handled them); rank 1 never writes its half.
            partial = {s["request_id"] for s in samples[1:]}
            rank0_agent = f"tp-r0-{rank0.pid}"
            deadline = time.monotonic() + 30
            seen_at: int | None = None
            while seen_at is None or watch.polls <= seen_at:
                landed = set(watch.landed)
                if seen_at is None and {(rank0_agent, r) for r in partial} <= landed:
                    seen_at = watch.polls
                assert time.monotonic() < deadline, f"B and C never held rank 0's half: {sorted(landed)}"
                time.sleep(0.05)
            assert not {(p, r) for p, r in landed if r in partial and p != rank0_agent}
            kill(rank0)
            rank1.close()
            with pytest.raises(TimeoutError):
                s = reader.get(timeout=2)
                pytest.fail(f"the reader yielded {s.request_id}, half of which was never written")
            assert_pool_idle(reader)
            whole_pool_producer(reader, checker, num_pages)
            assert checker.got["tp"] == [a["request_id"]]
        finally:
            rank1.close()
            if rank0 is not None and rank0.poll() is None:
                rank0.kill()
                rank0.communicate()
