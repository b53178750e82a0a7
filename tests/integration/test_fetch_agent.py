"""A rank's fetch agent between real processes over real NIXL, without vLLM: a producer
process holds samples in its ``PullServer`` (``pull_servers_main.py``); one fetch agent
(``reader.agent.fetch_agent``, its own process) READs them for clients in several threads and
processes of the "rank", which map its pool. Byte-exact samples, one NIXL agent and one
registration however many clients fetch, the leases of a client killed while it held a
sample freed, the agent gone when its rank is killed, clear errors, and a sample handed
out before the agent serves kept at its producer while the agent starts slowly."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kv_connector.reader import AgentClient, FetchAgentProcess, FetchError
from kv_connector.reader.agent.fetch_agent import START_PHASES
from kv_connector.reader.agent.wire import AgentFetch, AgentHello, AgentSample, FrameReader, frame
from kv_connector.wire.handle import PullHandle, decode_handle, make_nonce
from kv_connector.wire.provenance import Expectation
from scripts.support.proc_tree import made_a_nixl_agent
from tests.integration.common import REPO, child_env, expected_states, make_cache, token_ids
from tests.integration.pull_common import LTH, NUM_CACHE_BLOCKS, SEED, TLH, Producer, samples_spec, spec_of

pytestmark = pytest.mark.integration


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


WORKER = """
import pickle, sys, torch
client = pickle.loads(bytes.fromhex(sys.argv[1]))
out = {}
for h in sys.argv[3:]:
    s = client.fetch(h)
    out[s.request_id] = (s.token_ids, s.hidden_states)
torch.save(out, sys.argv[2])
from scripts.support.proc_tree import made_a_nixl_agent
print("made_a_nixl_agent", made_a_nixl_agent(), flush=True)
"""


@pytest.mark.parametrize("layout", [LTH, TLH], ids=["LTH", "TLH"])
def test_one_agent_serves_threads_and_processes_byte_exact_with_one_registration(
    layout: Any, producers: list[Producer], tmp_path: Path
) -> None:
    samples = samples_spec(12, layout, seed=5)
    p = Producer(spec_of(layout, samples, world_size=2))
    producers.append(p)
    cache = make_cache(layout, NUM_CACHE_BLOCKS, SEED, finite=True)
    with FetchAgentProcess(pool_bytes=4 << 20) as agent:
        # its start, timed phase by phase (what its log line says)
        assert list(agent.start_phases) == list(START_PHASES)
        assert all(p["wall_s"] is not None and p["wall_s"] >= 0 for p in agent.start_phases.values())
        client = AgentClient(agent.address)
        got: dict[str, Any] = {}
        errors: list[BaseException] = []

        def fetch(ids: list[str]) -> None:
            try:
                for rid in ids:
                    s = client.fetch(p.handles[rid])
                    got[rid] = (s.token_ids, s.hidden_states)
            except BaseException as e:  # reported below
                errors.append(e)

        ids = [s["request_id"] for s in samples]
        threads = [threading.Thread(target=fetch, args=(ids[i:6:3],)) for i in range(3)]
        for t in threads:
            t.start()
        procs = [  # two more "DataLoader workers", each with the client pickled
            subprocess.Popen(
                [sys.executable, "-c", WORKER, pickle.dumps(client).hex(), str(tmp_path / f"w{i}.pt"), *part],
                env=child_env({"PYTHONPATH": str(REPO)}),
                stdout=subprocess.PIPE,
                text=True,
            )
            for i, part in enumerate([[p.handles[r] for r in ids[6:9]], [p.handles[r] for r in ids[9:]]])
        ]
        for t in threads:
            t.join(60)
        for i, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
            assert out.split()[-2:] == ["made_a_nixl_agent", "False"]  # the workers made none
            got.update(torch.load(tmp_path / f"w{i}.pt"))
        assert not errors, errors
        stats = client.stats()
        assert agent.pid == stats.pid and made_a_nixl_agent(stats.pid)
        client.close()
    assert sorted(got) == sorted(ids)
    for s in samples:
        tokens, hidden = got[s["request_id"]]
        assert tokens.tolist() == token_ids(s["request_id"], s["num_tokens"])
        want = expected_states(cache, layout, s["block_ids"], s["num_tokens"])
        assert hidden.dtype == want.dtype and hidden.is_contiguous() and torch.equal(hidden, want)
    assert stats.fetched == len(samples) and stats.failed == 0 and stats.leases_held == 0
    # one connection per thread and process: 3 threads, 2 processes, and this thread's stats
    assert stats.registered_bytes == 4 << 20 and stats.clients_seen == 6
    polled = p.settled([0, 0])
    assert polled["held"] == [0, 0]  # every sample released at both ranks


def raw_connect(address: str) -> tuple[socket.socket, FrameReader, AgentHello]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
    for fd in fds:
        os.close(fd)
    reader = FrameReader()
    reader.feed(data)
    hello = reader.next()
    assert isinstance(hello, AgentHello)
    return sock, reader, hello


HOLDER = """
import socket, sys
from kv_connector.reader.agent.wire import AgentFetch, FrameReader, frame
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
r = FrameReader()
r.feed(socket.recv_fds(s, 1 << 16, 1)[0])
r.next()
s.sendall(frame(AgentFetch(sys.argv[2])))
while (m := r.next()) is None:
    r.feed(s.recv(1 << 16))
print(type(m).__name__, flush=True)
__import__("time").sleep(600)  # holds the sample: never says it is done
"""


def test_a_client_killed_while_holding_a_sample_gives_its_pages_back(producers: list[Producer]) -> None:
    samples = samples_spec(3, LTH, seed=9)
    p = Producer(spec_of(LTH, samples))
    producers.append(p)
    with FetchAgentProcess(pool_bytes=1 << 20) as agent:  # one page: room for one sample at a time
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, agent.address, p.handles["req-0"]],
            env=child_env({"PYTHONPATH": str(REPO)}),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None and holder.stdout.readline().strip() == "AgentSample"
        client = AgentClient(agent.address, timeout_s=30)
        assert client.stats().leases_held == 1
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        deadline = time.monotonic() + 10
        while client.stats().leases_held and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = client.stats()
        assert stats.leases_held == 0 and stats.freed_by_disconnect == 1
        for rid in ("req-1", "req-2"):  # the pool's one page is free again
            assert client.fetch(p.handles[rid]).request_id == rid
        # a raw client that leaves without saying done: the same
        sock, _reader, hello = raw_connect(agent.address)
        assert hello.pool_bytes == 1 << 20
        with pytest.raises(FetchError) as e:
            client.fetch(p.handles["req-0"])  # released by the agent already when it was read
        assert e.value.code == "released"
        sock.close()
        client.close()


RANK = """
import sys
from kv_connector.reader import FetchAgentProcess
agent = FetchAgentProcess(pool_bytes=1 << 20)
agent.start()
print(agent.pid, agent.address, flush=True)
__import__("time").sleep(600)
"""


def test_the_agent_dies_with_its_rank_and_clients_then_fail_by_name() -> None:
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK],
        env=child_env({"PYTHONPATH": str(REPO)}),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank.stdout is not None
        pid_text, address = rank.stdout.readline().split()
        pid = int(pid_text)
        client = AgentClient(address, timeout_s=5)
        assert client.stats().pid == pid
        rank.send_signal(signal.SIGKILL)
        rank.wait(10)
        deadline = time.monotonic() + 20
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), "the fetch agent outlived its rank"
        assert not Path(address).exists()  # and cleaned up its socket
        assert not Path(address).parent.exists()  # and the directory its rank made for it
        with pytest.raises(FetchError) as e:
            client.fetch("anything")
        assert e.value.code == "agent"
        with pytest.raises(FetchError) as e:
            AgentClient(address).stats()
        assert e.value.code == "agent" and address in str(e.value)
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_the_producers_refusals_pass_through_and_bad_input_is_named(producers: list[Producer]) -> None:
    samples = samples_spec(2, TLH, seed=4)
    p = Producer(spec_of(TLH, samples))
    producers.append(p)
    with pytest.raises(ValueError, match="pool_bytes"):
        FetchAgentProcess(pool_bytes=100)  # under one page: named before a process starts
    with FetchAgentProcess(pool_bytes=1 << 20) as agent:
        with pytest.raises(TypeError, match="stays with its rank"):
            pickle.dumps(agent)
        client = pickle.loads(pickle.dumps(AgentClient(agent.address)))
        h = decode_handle(p.handles["req-0"])
        forged = PullHandle(h.producer_id, h.request_id, make_nonce(), h.endpoints).encode()
        with pytest.raises(FetchError) as e:
            client.fetch(forged)
        assert e.value.code == "unknown"
        with pytest.raises(FetchError) as e:
            client.fetch("not a handle")
        assert e.value.code == "handle"
        with pytest.raises(FetchError) as e:
            client.fetch({"hidden_states": {"status": "failed", "error": "boom"}})
        assert e.value.code == "handle" and "boom" in str(e.value)
        held = p.poll()["held"][0]
        kept = client.fetch(p.handles["req-1"], release=False)
        assert p.poll()["held"] == [held]  # held by the producer until released
        client.release(p.handles["req-1"])
        assert p.poll()["held"] == [held - 1] and kept.request_id == "req-1"
        sock, _reader, _ = raw_connect(agent.address)  # a malformed frame ends that connection only
        sock.sendall(b"\x00\x00\x00\x05junk!")
        assert sock.recv(16) == b""
        sock.close()
        assert client.stats().failed == 2  # the forged handle and the non-handle
        client.close()


def test_an_agent_with_an_expectation_fails_another_sample_by_name_unread(producers: list[Producer]) -> None:
    """The rank's agent checks what the trainer expects before its READ, as a client does."""
    samples = samples_spec(2, TLH, seed=6)
    p = Producer(spec_of(TLH, samples))
    producers.append(p)
    expect = Expectation(layer_ids=[1, 2, 3], dtype="bfloat16")
    with FetchAgentProcess(pool_bytes=1 << 20, expect=expect) as agent:
        client = AgentClient(agent.address)
        with pytest.raises(FetchError) as e:
            client.fetch(p.handles["req-0"])
        assert e.value.code == "mismatch" and "expected [1, 2, 3]" in e.value.message, e.value
        assert client.stats().fetched == 0  # nothing was READ
        client.close()
    assert p.settled([1])["held"] == [1]  # its producer freed it at once; req-1 is still held


def test_frames_round_trip_and_bounds() -> None:
    r = FrameReader()
    msg = AgentFetch("h", release=False)
    data = frame(msg) + frame(AgentFetch("g"))
    r.feed(data[:3])
    assert r.next() is None
    r.feed(data[3:])
    assert r.next() == msg and r.next() == AgentFetch("g") and r.next() is None
    r.feed((1 << 30).to_bytes(4, "big"))
    with pytest.raises(ValueError, match="frame of"):
        r.next()
    assert isinstance(AgentSample, type) and json.dumps(msg.handle)


def _fetch_in_child(client: AgentClient, handle: str, out: Any) -> None:
    try:
        s = client.fetch(handle)
        out.put((s.request_id, s.hidden_states.shape[0], client.stats().connections))
    except BaseException as e:  # said to the parent
        out.put(repr(e))


def test_a_forked_child_makes_its_own_connection(producers: list[Producer]) -> None:
    import multiprocessing

    samples = samples_spec(2, TLH, seed=6)
    p = Producer(spec_of(TLH, samples))
    producers.append(p)
    with FetchAgentProcess(pool_bytes=1 << 20) as agent:
        client = AgentClient(agent.address, timeout_s=30)
        assert client.fetch(p.handles["req-0"]).request_id == "req-0"  # this thread's connection made
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_fetch_in_child, args=(client, p.handles["req-1"], out))
        child.start()
        got = out.get(timeout=60)
        child.join(30)
        # the child did not talk over the parent's connection: it made its own (2 connected)
        assert got == ("req-1", samples[1]["num_tokens"], 2), got
        assert client.stats().fetched == 2
        client.close()


SLOW_SITE = REPO / "tests" / "integration" / "slow_agent_site"


def test_a_hold_that_would_expire_while_the_agent_starts_is_kept_and_served(
    producers: list[Producer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent starts later than the producer holds a sample (its interpreter waits, as
    one starved of a core does): the sample it was started for is kept at both ranks and
    served byte-exact; one nobody kept expired meanwhile; a forged handle is refused."""
    timeout_s = 15.0
    samples = samples_spec(2, TLH, seed=13)
    p = Producer(spec_of(TLH, samples, world_size=2, timeout_s=timeout_s))  # the clocks run from now
    producers.append(p)
    cache = make_cache(TLH, NUM_CACHE_BLOCKS, SEED, finite=True)
    h = decode_handle(p.handles["req-0"])
    forged = PullHandle(h.producer_id, h.request_id, make_nonce(), h.endpoints).encode()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SLOW_SITE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("KV_TEST_AGENT_START_DELAY_S", str(timeout_s + 1))
    agent = FetchAgentProcess(pool_bytes=4 << 20)  # not started: its first start keeps
    try:
        agent.start(keep=[{"handle": p.handles["req-0"]}, forged])
        assert agent.start_s is not None and agent.start_s > timeout_s  # req-0 would have expired
        assert agent.kept.kept >= 2 and "req-0" in agent.kept.held_s  # both ranks kept it
        assert agent.kept.refused["req-0"].code == "unknown"  # the forged one: nothing kept
        started = agent.slow_start()
        assert started is not None and "interpreter and imports" in started
        client = AgentClient(agent.address)
        s = client.fetch(p.handles["req-0"])
        want = expected_states(cache, TLH, samples[0]["block_ids"], samples[0]["num_tokens"])
        assert s.token_ids.tolist() == token_ids("req-0", samples[0]["num_tokens"])
        assert torch.equal(s.hidden_states, want)
        with pytest.raises(FetchError) as e:
            client.fetch(p.handles["req-1"])  # nobody kept it
        assert e.value.code == "expired"
        client.close()
    finally:
        agent.close()
