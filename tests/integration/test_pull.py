"""Pull delivery between real processes over real NIXL, without vLLM: a producer process
holds samples in one ``PullServer`` per rank (``pull_servers_main.py``), this process
fetches them with ``reader.pull.client.PullClient``, READing the blocks straight from the
producer's cache. Byte-exact samples, TP shares gathered into one sample, releases that
free the producer's blocks, the timeout, and the errors a consumer must see clearly: an
expired, released, forged or stale handle, an unauthenticated peer, a share that does not
match its checksum (XXH3 of its bytes, or block digests taken where the cache is).

A producer process is shared by the module's tests of one configuration (``pulls``): each
test holds its own samples on it, and it is reset after the test (every hold ended, its
cache as made), so a test finds it as new. Tests that stop their producer or start a
second one of their own use ``producers``."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from kv_connector.reader import FetchError, PullClient
from kv_connector.reader.pool import memory as pool_memory
from kv_connector.wire import protocol
from kv_connector.wire.handle import PullHandle, decode_handle, make_nonce
from kv_connector.wire.layout import BlockLayout, stripe
from kv_connector.wire.provenance import Expectation
from tests.integration.common import REPO, child_env, expected_states, make_cache, token_ids
from tests.integration.pull_common import (
    LAYER_IDS,
    LTH,
    NUM_CACHE_BLOCKS,
    SEED,
    TLH,
    Producer,
    SharedProducers,
    samples_spec,
    spec_of,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("layout", [LTH, TLH], ids=["LTH", "TLH"])
def test_every_sample_is_read_byte_exact_and_its_blocks_are_freed(
    layout: BlockLayout, world: int, pulls: SharedProducers, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from kv_connector.reader.pool import memory as pool_memory  # where the pool's values check looks it up

    checked_on: list[str] = []
    real_check = pool_memory.find_bad_values

    def values_check(*args: Any, **kw: Any) -> Any:
        checked_on.append(threading.current_thread().name)
        return real_check(*args, **kw)

    monkeypatch.setattr(pool_memory, "find_bad_values", values_check)
    samples = samples_spec(6, layout)
    p = pulls.lend(spec_of(layout, samples, world_size=world))
    cache = make_cache(layout, NUM_CACHE_BLOCKS, SEED, finite=True)
    with PullClient(pool_bytes=4 << 20) as client:
        pickle.loads(pickle.dumps(client))  # picklable before first use (DataLoader workers)
        for s in samples[:3]:  # one at a time
            got = client.fetch(p.handles[s["request_id"]])
            assert got.token_ids.tolist() == token_ids(s["request_id"], s["num_tokens"])
            want = expected_states(cache, layout, s["block_ids"], s["num_tokens"])
            assert got.hidden_states.dtype == want.dtype and torch.equal(got.hidden_states, want)
            assert got.layer_ids == tuple(LAYER_IDS) and got.producer_id == "producer"
            got.release()
        # the rest with their READs in flight together, given as kv_transfer_params
        assert checked_on == [threading.current_thread().name] * 3
        many = client.fetch_many([{"handle": p.handles[s["request_id"]]} for s in samples[3:]])
        # checked on the client's checker thread while the next one was READ on this one
        assert checked_on[3:] == [f"{client.name}-check_0"] * 3
        for s, got in zip(samples[3:], many, strict=True):
            assert not isinstance(got, FetchError), got
            want = expected_states(cache, layout, s["block_ids"], s["num_tokens"])
            assert torch.equal(got.hidden_states, want)
        assert pickle.loads(pickle.dumps(client)).name != ""  # and after
    polled = p.settled([0] * world)
    assert polled["held"] == [0] * world
    assert [sorted(f) for f in polled["freed"]] == [sorted(s["request_id"] for s in samples)] * world
    # released: a second fetch gets no data, and says why
    with PullClient() as client, pytest.raises(FetchError) as e:
        client.fetch(p.handles["req-0"])
    assert e.value.code == "released"


def test_fetch_iter_streams_with_a_pool_of_exactly_its_reads_ahead_and_gives_pages_back_when_left(
    producers: list[Producer],
    pulls: SharedProducers,
) -> None:
    """``fetch_iter`` keeps ``in_flight`` samples asked for and READ ahead in a pool that
    holds just that many (each one the loop drops returns its pages before the next READ),
    in the order of the handles; a loop left early gives the samples read ahead back and
    leaves the one asked for ahead held."""
    from kv_connector.reader.pull.links import PAGE_BYTES

    samples = samples_spec(8, LTH)
    assert all(LTH.sample_bytes(LTH.blocks_for(s["num_tokens"])) <= PAGE_BYTES for s in samples)
    p = pulls.lend(spec_of(LTH, samples))
    cache = make_cache(LTH, NUM_CACHE_BLOCKS, SEED, finite=True)
    handles = [p.handles[s["request_id"]] for s in samples]
    with PullClient(pool_bytes=2 * PAGE_BYTES, timeout_s=5) as client:  # two samples, no more
        got_ids = []
        for s, got in zip(samples[:6], client.fetch_iter(handles[:6], in_flight=2), strict=True):
            assert not isinstance(got, FetchError), got
            assert torch.equal(
                got.hidden_states, expected_states(cache, LTH, s["block_ids"], s["num_tokens"])
            )
            got_ids.append(got.request_id)
            got.release()
        assert got_ids == [s["request_id"] for s in samples[:6]]
        stream = client.fetch_iter(handles[6:], in_flight=2)
        first = next(stream)  # the second is read ahead, holding the pool's other page
        assert not isinstance(first, FetchError)
        stream.close()  # left early
        first.release()
        with pytest.raises(ValueError, match="in_flight"):
            next(client.fetch_iter(handles, in_flight=0))
        # both pages are free again: two samples at once fit (without the read-ahead one's
        # page back, the second would wait for it and fail after timeout_s)
        more = Producer(spec_of(LTH, samples_spec(2, LTH, seed=9), producer_id="again"))
        producers.append(more)
        pair = client.fetch_many(list(more.handles.values()))
        assert all(not isinstance(x, FetchError) for x in pair), pair
        for x in pair:
            assert not isinstance(x, FetchError)
            x.release()
        # left early with the next sample asked for ahead on the client's asker thread (its
        # round trip overlaps the READ being posted) and never READ: it stays held at its
        # producer, as if never asked for, and is fetched whole later
        specs = samples_spec(3, LTH, seed=11)
        later = Producer(spec_of(LTH, specs, producer_id="later"))
        producers.append(later)
        hs = [later.handles[s["request_id"]] for s in specs]
        stream = client.fetch_iter(hs, in_flight=1)
        first = next(stream)
        assert not isinstance(first, FetchError)
        first.release()
        stream.close()
        for s, x in zip(specs[1:], client.fetch_many(hs[1:]), strict=True):
            assert not isinstance(x, FetchError), x
            assert torch.equal(x.hidden_states, expected_states(cache, LTH, s["block_ids"], s["num_tokens"]))


@pytest.mark.parametrize("layout", [LTH, TLH], ids=["LTH", "TLH"])
def test_copying_mode_hands_out_contiguous_copies_in_reused_buffers(
    layout: BlockLayout, pulls: SharedProducers
) -> None:
    samples = samples_spec(6, layout)
    p = pulls.lend(spec_of(layout, samples))
    cache = make_cache(layout, NUM_CACHE_BLOCKS, SEED, finite=True)
    kept = []
    with PullClient(pool_bytes=1 << 20, copy=True) as client:
        for i, s in enumerate(samples):
            got = client.fetch(p.handles[s["request_id"]])
            assert not got.leased and got.hidden_states.is_contiguous()  # a copy: no lease
            want = expected_states(cache, layout, s["block_ids"], s["num_tokens"])
            assert torch.equal(got.hidden_states, want)
            if i < 2:
                kept.append((got.hidden_states, want))  # held: its buffer is not reused
            del got
        made = client.copies_made
    assert made < len(samples)  # buffers of samples let go were used again
    for hidden, want in kept:  # what is held was never overwritten by later samples
        assert torch.equal(hidden, want)
    assert p.settled([0])["held"] == [0]


def test_a_manifest_is_read_without_the_states_and_the_sample_stays_held(pulls: SharedProducers) -> None:
    samples = samples_spec(2, LTH)
    p = pulls.lend(spec_of(LTH, samples, world_size=2))
    with PullClient() as client:
        m = client.manifest(p.handles["req-0"])
        assert m.request_id == "req-0" and m.num_tokens == samples[0]["num_tokens"]
        assert m.token_ids == token_ids("req-0", samples[0]["num_tokens"]) and m.layer_ids == LAYER_IDS
        assert p.poll()["held"] == [2, 2]  # nothing read, nothing released
        got = client.fetch(p.handles["req-0"])  # still there to fetch
        assert torch.equal(got.token_ids, torch.tensor(m.token_ids))
        del got
        client.release(p.handles["req-1"])
        with pytest.raises(FetchError) as e:
            client.manifest(p.handles["req-1"])
        assert e.value.code == "released"
    assert p.settled([0, 0])["held"] == [0, 0]


def test_a_sample_other_than_expected_fails_by_name_unread_and_is_freed(pulls: SharedProducers) -> None:
    samples = samples_spec(2, LTH)
    p = pulls.lend(spec_of(LTH, samples, world_size=2))
    with PullClient(expect=Expectation(layer_ids=[1, 2, 3], dtype="bfloat16")) as client:
        with pytest.raises(FetchError) as e:
            client.fetch(p.handles["req-0"])
        assert e.value.code == "mismatch"
        assert "layer ids [1, 2, 4], expected [1, 2, 3]" in e.value.message
        assert "dtype float32, expected bfloat16" in e.value.message
    assert p.settled([1, 1])["held"] == [1, 1]  # its producer freed it at once; req-1 is still held
    with PullClient(expect=Expectation(layer_ids=LAYER_IDS, dtype="float32", hidden_size=32)) as client:
        got = client.fetch(p.handles["req-1"])
        assert got.layer_ids == tuple(LAYER_IDS)
        del got
    assert p.settled([0, 0])["held"] == [0, 0]


def test_a_sample_never_released_is_freed_by_the_timeout_and_then_expired(producers: list[Producer]) -> None:
    samples = samples_spec(2, LTH)
    # the client (its agent, its pool) is made first: on a busy host that took longer than
    # the hold, and the first sample expired before it was asked for
    with PullClient() as client:
        p = Producer(spec_of(LTH, samples, timeout_s=3.0))
        producers.append(p)
        first = client.fetch(p.handles["req-0"])  # released at once: not the timeout's
        first.release()
        deadline_passed = False
        for _ in range(200):
            polled = p.poll()
            if "req-1" in polled["freed"][0]:
                deadline_passed = True
                break
            import time

            time.sleep(0.1)
        assert deadline_passed and polled["held"] == [0]
        with pytest.raises(FetchError) as e:
            client.fetch(p.handles["req-1"])
        assert e.value.code == "expired" and "pull_timeout_s" in e.value.message
    assert "req-1 was not released within pull_timeout_s" in p.stop()


def test_forged_and_stale_handles_get_a_clear_error_and_no_data(pulls: SharedProducers) -> None:
    samples = samples_spec(1, LTH)
    p = pulls.lend(spec_of(LTH, samples))
    real = decode_handle(p.handles["req-0"])
    with PullClient() as client:
        forged = PullHandle(real.producer_id, real.request_id, make_nonce(), real.endpoints).encode()
        with pytest.raises(FetchError) as e:
            client.fetch(forged)  # the right request, a guessed nonce
        assert e.value.code == "unknown"
        with pytest.raises(FetchError) as e:
            client.fetch(PullHandle(real.producer_id, "req-9", real.nonce, real.endpoints).encode())
        assert e.value.code == "unknown"
        with pytest.raises(FetchError) as e:
            client.fetch(PullHandle("someone-else", real.request_id, real.nonce, real.endpoints).encode())
        assert e.value.code == "unknown" and "stale handle" in e.value.message
        for junk in (
            "not a handle",
            p.handles["req-0"][:-9],
            {"hidden_states": {"status": "failed", "error": "x"}},
        ):
            with pytest.raises(FetchError) as e:
                client.fetch(junk)
            assert e.value.code == "handle"
        # the forged attempts freed nothing: the real handle still works
        assert client.fetch(p.handles["req-0"]).token_ids.tolist() == token_ids(
            "req-0", samples[0]["num_tokens"]
        )
    assert p.settled([0])["held"] == [0]


def test_a_restarted_producer_is_handshaken_again_and_its_old_handles_fail(producers: list[Producer]) -> None:
    first = Producer(spec_of(LTH, samples_spec(2, LTH)))
    producers.append(first)
    with PullClient() as client:
        client.fetch(first.handles["req-0"]).release()
        old = first.handles["req-1"]
        first.stop()
        again = Producer(spec_of(LTH, samples_spec(2, LTH, seed=4), producer_id="producer"))
        producers.append(again)
        with pytest.raises(FetchError) as e:
            client.fetch(old)  # its endpoint is gone
        assert e.value.code == "connect"
        got = client.fetch(again.handles["req-1"])  # a new agent, a new handshake
        assert got.token_ids.tolist() == token_ids("req-1", samples_spec(2, LTH, seed=4)[1]["num_tokens"])


@pytest.mark.parametrize("client_secret", [None, "wrong"])
def test_a_consumer_without_the_producers_secret_is_refused(
    client_secret: str | None, pulls: SharedProducers
) -> None:
    p = pulls.lend(spec_of(LTH, samples_spec(1, LTH)), env={"KV_CONNECTOR_SECRET": "s3cret"})
    secret = client_secret.encode() if client_secret else None
    with PullClient(secret=secret) as client, pytest.raises(FetchError) as e:
        if secret is None:
            import os

            assert "KV_CONNECTOR_SECRET" not in os.environ
        client.fetch(p.handles["req-0"])
    assert e.value.code == "auth"
    with PullClient(secret=b"s3cret") as client:  # the same sample, with the secret
        assert client.fetch(p.handles["req-0"]).request_id == "req-0"


def test_a_producer_with_a_secret_is_refused_by_a_consumer_expecting_none(pulls: SharedProducers) -> None:
    """The other way round: the consumer has a secret, the producer none."""
    p = pulls.lend(spec_of(LTH, samples_spec(1, LTH)), env={"KV_CONNECTOR_SECRET": None})
    with PullClient(secret=b"mine") as client, pytest.raises(FetchError) as e:
        client.fetch(p.handles["req-0"])
    assert e.value.code == "auth"


KILLED_CONSUMER = """
import os, signal, sys
from kv_connector.reader import PullClient
s = PullClient().fetch(sys.argv[1], release=False)  # read, checked, still held at the producer
print(s.request_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a DataLoader worker killed before its release
"""


def test_a_sample_read_by_a_consumer_killed_before_its_release_is_freed_by_the_timeout(
    pulls: SharedProducers,
) -> None:

    p = pulls.lend(spec_of(LTH, samples_spec(1, LTH), timeout_s=12.0))
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_CONSUMER, p.handles["req-0"]],
        capture_output=True, text=True, timeout=120, env=child_env({"PYTHONPATH": str(REPO)}),
    )  # fmt: skip
    assert proc.returncode == -9 and proc.stdout.strip() == "req-0", proc.stderr[-3000:]
    assert p.poll() == {"freed": [[]], "held": [1]}  # its death released nothing
    while time.monotonic() < t0 + 60 and p.poll()["held"] != [0]:
        time.sleep(0.2)
    assert p.poll()["held"] == [0]
    with PullClient() as client, pytest.raises(FetchError) as e:
        client.fetch(p.handles["req-0"])
    assert e.value.code == "expired"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("layout", [LTH, TLH], ids=["LTH", "TLH"])
def test_block_digests_taken_where_the_cache_is_are_verified_by_the_client(
    layout: BlockLayout, world: int, monkeypatch: pytest.MonkeyPatch, pulls: SharedProducers
) -> None:
    """The checksum a GPU cache gets by default (block digests computed with torch where
    the cache is, nothing staged), forced on a CPU cache as push's tests do: every share
    says so and the client recomputes the block digests from the bytes it READ."""
    samples = samples_spec(6, layout, seed=5)
    p = pulls.lend(spec_of(layout, samples, world_size=world, checksum="blocks"))
    checked: list[str] = []
    real = pool_memory.sample_block_digests

    def counting(states: torch.Tensor, m: protocol.Manifest, blocks: list[int]) -> list[int]:
        checked.append(m.request_id)
        return real(states, m, blocks)

    monkeypatch.setattr(pool_memory, "sample_block_digests", counting)
    monkeypatch.setattr(pool_memory, "sample_checksum", None)  # never called: no share is XXH3
    cache = make_cache(layout, NUM_CACHE_BLOCKS, SEED, finite=True)
    with PullClient(pool_bytes=4 << 20) as client:
        got = client.fetch_many([p.handles[s["request_id"]] for s in samples])
    for s, sample in zip(samples, got, strict=True):
        assert not isinstance(sample, FetchError), sample
        want = expected_states(cache, layout, s["block_ids"], s["num_tokens"])
        assert torch.equal(sample.hidden_states, want)
    shares = [
        s["request_id"]
        for s in samples
        for r in range(world)
        if stripe(layout.blocks_for(s["num_tokens"]), r, world)  # an empty share has no checksum
    ]
    assert sorted(checked) == sorted(shares)
    assert p.settled([0] * world)["held"] == [0] * world


@pytest.mark.parametrize("checksum", ["blocks", "xxh3"])
@pytest.mark.parametrize("layout", [LTH, TLH], ids=["LTH", "TLH"])
def test_blocks_in_padded_pages_are_read_without_their_padding(
    layout: BlockLayout, checksum: str, pulls: SharedProducers
) -> None:
    """A cache whose blocks lie in pages vLLM padded to its other groups' page size (a
    hybrid model's cache-only layer in vLLM's own grouping): each share says its blocks'
    pitch, the client READs each block from its page's start and never the padding, and
    the checksum (taken over the same blocks by the module push uses) matches."""
    samples = samples_spec(4, layout, seed=8)
    pad = 3 * layout.block_bytes + 40  # not a whole number of blocks
    p = pulls.lend(spec_of(layout, samples, world_size=2, checksum=checksum, pad_bytes=pad))
    cache = make_cache(layout, NUM_CACHE_BLOCKS, SEED, finite=True, pad_bytes=pad)
    with PullClient(pool_bytes=4 << 20) as client:
        got = client.fetch_many([p.handles[s["request_id"]] for s in samples])
    for s, sample in zip(samples, got, strict=True):
        assert not isinstance(sample, FetchError), sample
        want = expected_states(cache, layout, s["block_ids"], s["num_tokens"])
        assert torch.equal(sample.hidden_states, want)
    assert p.settled([0, 0])["held"] == [0, 0]


@pytest.mark.parametrize("checksum", ["blocks", "xxh3"])
def test_a_block_garbled_after_its_checksum_was_taken_fails_the_fetch_by_name(
    checksum: str, pulls: SharedProducers
) -> None:
    """A block that changes in the cache after its share's checksum was taken (as when
    vLLM reuses it): the next fetch READs the new bytes, they do not match, and the fetch
    fails naming the sample, whichever kind of checksum the producer sends."""
    samples = samples_spec(2, TLH, seed=6)
    p = pulls.lend(spec_of(TLH, samples, checksum=checksum))
    with PullClient() as client:
        first = client.fetch(p.handles["req-0"], release=False)  # the checksum is taken, kept
        first.release()
        p.garble("req-0")
        with pytest.raises(FetchError) as e:
            client.fetch(p.handles["req-0"])
        assert e.value.code == "checksum" and "sample req-0" in e.value.message
        assert checksum in e.value.message
        assert client.fetch(p.handles["req-1"]).request_id == "req-1"  # the others still arrive


FAULTS = ["slot", "tail", "swap", "layer"]  # what the default record must catch (docs/reliability.md)


def faulted_spec(layout: BlockLayout) -> list[dict[str, Any]]:
    bs = layout.block_size
    return [
        {"request_id": "req-0", "num_tokens": 2 * bs + 5, "block_ids": [30, 7, 12]},
        {"request_id": "req-1", "num_tokens": bs + 1, "block_ids": [3, 40]},
    ]


@pytest.mark.parametrize("checksum", ["auto", "none"])
@pytest.mark.parametrize("kind", [*FAULTS, "bit"])
def test_a_fault_after_the_step_that_wrote_a_sample_fails_it_by_name_before_anyone_asked(
    kind: str, checksum: str, pulls: SharedProducers
) -> None:
    """The sample is held (its words taken as the step that wrote it takes them) and its
    blocks are damaged before any consumer asked for it, as vLLM's reuse or a late write
    does: under the default (fingerprints) the fetch fails naming the sample and hands out
    nothing, and the producer goes on serving the others; with the record switched off the
    damage is handed out (the check is what catches it). One bit flipped in a word no
    fingerprint samples is the documented exception: handed out either way."""
    layout = TLH
    samples = faulted_spec(layout)
    p = pulls.lend(spec_of(layout, samples, checksum=checksum, world_size=2))
    p.fault("req-0", kind)
    cache = make_cache(layout, NUM_CACHE_BLOCKS, SEED, finite=True)
    original = expected_states(cache, layout, samples[0]["block_ids"], samples[0]["num_tokens"])
    with PullClient(check_values=False) as client:
        if checksum == "auto" and kind != "bit":
            with pytest.raises(FetchError) as e:
                client.fetch(p.handles["req-0"])
            assert e.value.code == "checksum" and "sample req-0" in e.value.message
        else:
            got = client.fetch(p.handles["req-0"])
            assert not torch.equal(got.hidden_states, original)  # the damage, handed out
            got.release()
        other = client.fetch(p.handles["req-1"])
        want = expected_states(cache, layout, samples[1]["block_ids"], samples[1]["num_tokens"])
        assert torch.equal(other.hidden_states, want)


@pytest.mark.parametrize("fences", [True, False], ids=["fences", "no-fences"])
@pytest.mark.parametrize("how", ["released", "reassigned"])
def test_a_hold_that_ends_while_its_sample_is_read_fails_it_by_name(
    how: str, fences: bool, pulls: SharedProducers
) -> None:
    """Each rank ends the sample's hold right after it answered the fetch, while the
    consumer READs: released (as by another consumer), or reassigned (preempted, and
    another sample's row written into a block, as vLLM's reuse does). The consumer READs
    each hold's fence word after its data landed and fails the sample by how the hold
    ended, handing out nothing; the producer goes on serving. Without fences a reassigned
    hold is still caught by the fingerprint (its bytes changed), but a released one, whose
    blocks vLLM may reuse any moment, is handed out."""
    samples = faulted_spec(TLH)
    p = pulls.lend(spec_of(TLH, samples, world_size=2, fences=fences))
    p.end("req-0", how)
    with PullClient(check_values=False) as client:
        if fences or how == "reassigned":
            with pytest.raises(FetchError) as e:
                client.fetch(p.handles["req-0"])
            want = ("released" if how == "released" else "preempted") if fences else "checksum"
            assert e.value.code == want and "sample req-0" in e.value.message, e.value
            if fences:
                assert "ended before the READ completed" in e.value.message
        else:
            client.fetch(p.handles["req-0"]).release()  # what only the fence sees
        cache = make_cache(TLH, NUM_CACHE_BLOCKS, SEED, finite=True)
        other = client.fetch(p.handles["req-1"])
        want_states = expected_states(cache, TLH, samples[1]["block_ids"], samples[1]["num_tokens"])
        assert torch.equal(other.hidden_states, want_states)
    held = p.settled([0, 0])["held"]
    assert held == [0, 0]  # both samples' blocks go back, whatever ended them


def test_a_layer_zeroed_over_a_whole_sample_is_caught_by_the_values_screen_without_a_record(
    pulls: SharedProducers,
) -> None:
    samples = faulted_spec(TLH)
    p = pulls.lend(spec_of(TLH, samples, checksum="none"))
    p.fault("req-0", "layer")
    with PullClient() as client:
        with pytest.raises(FetchError) as e:
            client.fetch(p.handles["req-0"])
        assert e.value.code == "values" and "req-0" in e.value.message
        assert client.fetch(p.handles["req-1"]).request_id == "req-1"


def test_with_fingerprints_a_wide_samples_values_are_screened_on_the_lines_its_checks_read(
    pulls: SharedProducers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default record (fingerprints) and rows wide enough for the screen to sample: each
    share's rows are screened on the lines its check reads, so a good sample is handed out
    without another read of it, and states the step wrote bad (a layer zero over the whole
    sample, zero tokens) are refused by name, the screen looking closer where they showed."""
    from kv_connector.reader.pool import memory as pool_memory

    looked_closer: list[int] = []
    real_check = pool_memory.find_bad_values

    def values_check(*args: Any, **kw: Any) -> Any:
        looked_closer.append(1)
        return real_check(*args, **kw)

    monkeypatch.setattr(pool_memory, "find_bad_values", values_check)
    wide = BlockLayout("TLH", 16, 3, 256, "bfloat16")
    samples = [*faulted_spec(wide), {"request_id": "req-2", "num_tokens": 20, "block_ids": [5, 6]}]
    samples[0]["before"], samples[1]["before"] = "layer", "tail"
    p = pulls.lend(spec_of(wide, samples))
    cache = make_cache(wide, NUM_CACHE_BLOCKS, SEED, finite=True)
    with PullClient() as client:
        got = client.fetch(p.handles["req-2"])
        assert torch.equal(got.hidden_states, expected_states(cache, wide, [5, 6], 20))
        assert looked_closer == []  # screened on the checks' read alone
        got.release()
        for rid, why in (
            ("req-0", f"captured layer ids {LAYER_IDS[1]} all zero at every one of the 37"),
            ("req-1", "all zero in"),
        ):
            with pytest.raises(FetchError) as e:
                client.fetch(p.handles[rid])
            assert e.value.code == "values" and why in e.value.message, e.value.message
        assert len(looked_closer) == 2


def test_a_shared_producer_is_as_new_after_its_reset(pulls: SharedProducers) -> None:
    """What lets the module's tests share a producer: after a test that damaged its cache
    and left samples held, the reset ends every hold and puts the cache back as made, and
    the same samples held again arrive exact."""
    samples = samples_spec(3, TLH, seed=6)
    p = pulls.lend(spec_of(TLH, samples, checksum="xxh3"))
    p.garble(samples[0]["request_id"])
    p.fault(samples[1]["request_id"], "tail")
    assert p.poll()["held"] == [3]
    assert p.reset() == [0] and p.poll() == {"freed": [[]], "held": [0]}
    handles = p.hold(samples)
    cache = make_cache(TLH, NUM_CACHE_BLOCKS, SEED, finite=True)
    with PullClient() as client:
        got = client.fetch_many([handles[s["request_id"]] for s in samples])
    for s, sample in zip(samples, got, strict=True):
        assert not isinstance(sample, FetchError), sample
        assert torch.equal(sample.hidden_states, expected_states(cache, TLH, s["block_ids"], s["num_tokens"]))
    assert p.settled([0])["held"] == [0]
