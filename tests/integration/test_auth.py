"""The handshake's shared-secret authentication between real processes: a reader in this
process, producers as sender subprocesses (tests/integration/sender_main.py) and raw TCP
peers that speak the framing by hand.

Hello -> Challenge (the reader proves the secret) -> Auth (the producer proves it and
sends its NIXL metadata) -> Welcome. A mismatch on either side must refuse the peer
before any NIXL metadata or pool address travels, with a clear reason, and the reader
must keep serving honest producers; the secret itself must never reach a log.
"""

from __future__ import annotations

import json
import logging
import os
import random
import select
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kv_connector.reader import HiddenStatesReader, Sample
from kv_connector.sender.sender import HiddenStatesSender, SenderConfig
from kv_connector.wire import auth, protocol
from kv_connector.wire.control import ConnectionClosed, FramedConnection, parse_address
from kv_connector.wire.handshake import ReaderHandshake
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.nixl_transport import NixlTransport as Transport
from tests.integration.common import (
    REPO,
    Senders,
    child_env,
    expected_states,
    finish_sender,
    layout_dict,
    make_cache,
    same_bytes,
    start_sender,
    token_ids,
)
from tests.integration.faulty_transport import FaultyTransport, watched_reader

pytestmark = pytest.mark.integration

LAYOUT = BlockLayout("LTH", 16, 3, 64, "float32")
NUM_CACHE_BLOCKS = 32
POOL_BYTES = 32 * LAYOUT.block_bytes
# A subprocess inherits our environment; an empty value means "no secret" to auth.load_secret.
NO_SECRET_ENV: dict[str, str | None] = {auth.SECRET_ENV: None, auth.SECRET_FILE_ENV: None}
SENDER_MAIN = REPO / "tests" / "integration" / "sender_main.py"
# sender_main.py configures no logging (only WARNING and above would reach stderr through
# logging.lastResort); this wrapper runs it with every record at DEBUG on stderr, so that
# "the secret is never logged" is checked against everything the sender logs.
LOGGED_SENDER = (
    "import logging, runpy, sys; "
    "logging.basicConfig(level=logging.DEBUG, format='%(levelname)s %(name)s: %(message)s'); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def new_secret() -> str:
    return f"s3cr3t-{uuid.uuid4().hex}"


@pytest.fixture(autouse=True)
def _no_inherited_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the environment running the tests holds, each test decides the secrets."""
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)


def plan(tag: str, sizes: list[int], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "request_id": f"{tag}-{i}",
            "num_tokens": n,
            "block_ids": rng.sample(range(NUM_CACHE_BLOCKS), -(-n // LAYOUT.block_size)),
        }
        for i, n in enumerate(sizes)
    ]


def sender_spec(
    address: str, samples: list[dict[str, Any]], seed: int, producer_id: str, connect_timeout_s: float = 30.0
) -> dict[str, Any]:
    return dict(
        address=address,
        producer_id=producer_id,
        layout=layout_dict(LAYOUT),
        num_cache_blocks=NUM_CACHE_BLOCKS,
        seed=seed,
        samples=samples,
        connect_timeout_s=connect_timeout_s,
        timeout_s=60.0,
    )


def start_logged_sender(spec: dict[str, Any], env: dict[str, str | None]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", LOGGED_SENDER, str(SENDER_MAIN), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(env),
    )


def collect(reader: HiddenStatesReader, n: int, timeout: float = 60) -> dict[str, Sample]:
    got: dict[str, Sample] = {}
    for _ in range(n):
        s = reader.get(timeout=timeout, copy=True)
        assert s.request_id not in got, f"{s.request_id} delivered twice"
        got[s.request_id] = s
    return got


def check_samples(got: dict[str, Sample], samples: list[dict[str, Any]], seed: int) -> None:
    cache = make_cache(LAYOUT, NUM_CACHE_BLOCKS, seed)
    assert set(got) == {s["request_id"] for s in samples}
    for s in samples:
        g = got[s["request_id"]]
        assert g.token_ids.tolist() == token_ids(s["request_id"], s["num_tokens"])
        want = expected_states(cache, LAYOUT, s["block_ids"], s["num_tokens"])
        assert same_bytes(g.hidden_states, want), f"{s['request_id']} differs from the producer's cache"


def run_honest_producer(reader: HiddenStatesReader, secret: str | None, seed: int) -> None:
    """A subprocess producer with ``secret`` ships three samples; all arrive byte-exact."""
    samples = plan(f"honest{seed}", [1, LAYOUT.block_size + 3, 5 * LAYOUT.block_size], seed)
    env = {auth.SECRET_ENV: secret} if secret is not None else NO_SECRET_ENV
    proc = start_sender(sender_spec(reader.address, samples, seed, f"honest-{seed}"), env=env)
    try:
        got = collect(reader, len(samples), timeout=60)
        res = finish_sender(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    check_samples(got, samples, seed)


def assert_no_sample(reader: HiddenStatesReader, wait: float = 0.5) -> None:
    with pytest.raises(TimeoutError):
        s = reader.get(timeout=wait, copy=True)
        pytest.fail(f"unexpected sample {s.request_id} from {s.producer_id}")


def pool_untouched(transport: FaultyTransport) -> bool:
    """The receive pool (the reader's transport registered it) starts zeroed: no byte of
    it was written."""
    (pool,) = transport.registered
    return int(torch.count_nonzero(pool)) == 0


# ------------------------------------------------------------------- raw peers
class RawPeer:
    """A hand-driven control connection to the reader."""

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        host, port = parse_address(address)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.conn = FramedConnection(self.sock, send_timeout=timeout)

    def send(self, msg: protocol._Msg) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float = 5.0) -> protocol.Message:
        return self.conn.receive_one(timeout)

    def hello(
        self, producer_id: str, rank: int = 0, world_size: int = 1, nonce: bytes | None = None
    ) -> bytes:
        nonce = nonce or auth.make_nonce()
        self.send(
            protocol.Hello(
                version=protocol.PROTOCOL_VERSION,
                producer_id=producer_id,
                rank=rank,
                world_size=world_size,
                agent_name=f"{producer_id}-agent",
                block_bytes=LAYOUT.block_bytes,
                nonce=nonce,
            )
        )
        return nonce

    def expect_refused(self, match: str, timeout: float = 5.0) -> protocol.Refuse:
        """The reader answers with a connection-level Refuse naming ``match`` and closes."""
        msg = self.recv(timeout)
        assert isinstance(msg, protocol.Refuse), f"expected a refusal, got {msg!r}"
        assert msg.code == "protocol" and msg.request_id == ""
        assert match in msg.message, msg.message
        self.expect_closed(timeout)
        return msg

    def expect_closed(self, timeout: float = 5.0) -> None:
        r, _, _ = select.select([self.sock], [], [], timeout)
        assert r, "the reader kept the connection open"
        with pytest.raises(ConnectionClosed):
            self.conn.receive()

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def raw_peers() -> Iterator[list[RawPeer]]:
    peers: list[RawPeer] = []
    try:
        yield peers
    finally:
        for p in peers:
            p.close()


def deliver_in_process(reader: HiddenStatesReader, secret: bytes | None, tag: str) -> None:
    """An in-process sender ships one three-block sample; it arrives byte-exact and acked."""
    cache = make_cache(LAYOUT, NUM_CACHE_BLOCKS, seed=7)
    sender = HiddenStatesSender(
        SenderConfig(reader.address, f"inproc-{tag}", connect_timeout_s=10),
        cache,
        LAYOUT,
        list(range(LAYOUT.num_layers)),
        secret=secret,
    )
    try:
        blocks, n = [9, 2, 30], 2 * LAYOUT.block_size + 1
        sender.ship(f"{tag}-r", token_ids(f"{tag}-r", n), blocks)
        got = reader.get(timeout=20, copy=True)
        assert got.request_id == f"{tag}-r"
        assert same_bytes(got.hidden_states, expected_states(cache, LAYOUT, blocks, n))
        deadline = time.monotonic() + 10
        while f"{tag}-r" not in sender.take_finished():
            assert time.monotonic() < deadline, "the sample was never acknowledged"
            assert not sender.take_failed()
            time.sleep(0.005)
    finally:
        sender.close()


# ----------------------------------------------------------------------- tests
@pytest.mark.parametrize("reader_source, sender_source", [("arg", "env"), ("env", "file"), ("file", "env")])
def test_matching_secret_delivers_byte_exact(
    reader_source: str, sender_source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, senders: Senders
) -> None:
    secret = new_secret()
    path = tmp_path / "secret"
    path.write_text(secret + "\n")  # the file's trailing newline is not part of the secret
    if reader_source == "env":
        monkeypatch.setenv(auth.SECRET_ENV, secret)
    elif reader_source == "file":
        monkeypatch.setenv(auth.SECRET_FILE_ENV, str(path))
    env = (
        {auth.SECRET_ENV: secret, auth.SECRET_FILE_ENV: ""}
        if sender_source == "env"
        else {auth.SECRET_ENV: None, auth.SECRET_FILE_ENV: str(path)}
    )
    samples = plan("match", [1, 17, 3 * LAYOUT.block_size, 7 * LAYOUT.block_size + 5], seed=11)
    reader_secret = secret.encode() if reader_source == "arg" else None
    with HiddenStatesReader(pool_bytes=POOL_BYTES, secret=reader_secret) as reader:
        monkeypatch.delenv(auth.SECRET_ENV, raising=False)
        monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
        # The reader demands the secret: a Challenge says so and proves it.
        peer = RawPeer(reader.address)
        try:
            nonce = peer.hello("probe")
            ch = peer.recv()
            assert isinstance(ch, protocol.Challenge) and ch.auth_required
            assert auth.verify(auth.proof(secret.encode(), "reader", "probe", 0, nonce, ch.nonce), ch.proof)
        finally:
            peer.close()
        proc = senders.start(sender_spec(reader.address, samples, 11, "matching"), env=env)
        got = collect(reader, len(samples))
        res = finish_sender(proc)
    assert res["rc"] == 0 and not res["failed"], res["stderr"][-3000:]
    assert sorted(res["finished"]) == sorted(s["request_id"] for s in samples)
    check_samples(got, samples, seed=11)
    assert all(s.producer_id == "matching" for s in got.values())


@pytest.mark.parametrize(
    "producer_secret, reason_parts",
    [
        (None, ["requires a shared secret", auth.SECRET_ENV]),
        ("wrong", ["authentication", "shared secret"]),
    ],
    ids=["no-secret", "wrong-secret"],
)
def test_a_producer_without_the_secret_is_refused_and_the_reader_keeps_serving(
    producer_secret: str | None, reason_parts: list[str], senders: Senders
) -> None:
    secret = new_secret()
    samples = plan("intruder", [5, 40], seed=12)
    env = NO_SECRET_ENV if producer_secret is None else {auth.SECRET_ENV: new_secret()}
    reader, watch = watched_reader(pool_bytes=POOL_BYTES, secret=secret.encode())
    with reader:
        proc = senders.start(
            sender_spec(reader.address, samples, 12, "intruder", connect_timeout_s=2.0), env=env
        )
        res = finish_sender(proc, timeout=60)
        assert res["rc"] == 1 and res["finished"] == []
        assert set(res["failed"]) == {s["request_id"] for s in samples}
        for reason in res["failed"].values():
            for part in reason_parts:
                assert part in reason, reason
        assert_no_sample(reader)
        assert pool_untouched(watch), "a refused producer wrote into the receive pool"
        assert reader.stats().samples == 0
        # The reader still serves a producer that has the secret.
        run_honest_producer(reader, secret, seed=13)
        assert reader.stats().samples == 3


@pytest.mark.parametrize("producer_secret", [None, b"wrong-secret"], ids=["no-secret", "wrong-secret"])
def test_the_reader_warns_about_a_producer_refused_for_its_secret(
    producer_secret: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with HiddenStatesReader(pool_bytes=POOL_BYTES, secret=b"the-right-secret") as reader:
        cache = make_cache(LAYOUT, NUM_CACHE_BLOCKS, seed=1)
        sender = HiddenStatesSender(
            SenderConfig(reader.address, "misconfigured", connect_timeout_s=1),
            cache,
            LAYOUT,
            list(range(LAYOUT.num_layers)),
            secret=producer_secret,
        )
        try:
            sender.ship("m-0", token_ids("m-0", 20), [1, 2])
            deadline = time.monotonic() + 10
            failed: dict[str, str] = {}
            while not failed and time.monotonic() < deadline:
                time.sleep(0.05)
                failed = sender.take_failed()
            assert "m-0" in failed
            assert_no_sample(reader, 0.2)
        finally:
            sender.close()
        deliver_in_process(reader, b"the-right-secret", "after-misconfigured")
    warnings = [
        r for r in caplog.records if r.name.startswith("kv_connector.reader") and r.levelno >= logging.WARNING
    ]
    assert any("misconfigured" in r.getMessage() for r in warnings), (
        "the reader's operator is not told that producer 'misconfigured' was turned away: "
        + "; ".join(f"{r.levelname} {r.getMessage()}" for r in caplog.records if r.name.startswith("kv_"))
    )


def test_a_producer_with_a_secret_refuses_a_reader_without_one(
    monkeypatch: pytest.MonkeyPatch, senders: Senders
) -> None:
    """The producer checks the reader's proof first: a reader without the secret never
    receives the producer's Auth (its proof and NIXL metadata)."""
    calls: dict[str, list[str]] = {"hello": []}
    on_hello = ReaderHandshake.on_hello

    def spy_hello(self: ReaderHandshake, h: protocol.Hello, *rest: Any) -> protocol.Challenge:
        calls["hello"].append(h.producer_id)
        return on_hello(self, h, *rest)

    monkeypatch.setattr(ReaderHandshake, "on_hello", spy_hello)
    samples = plan("careful", [3, 33], seed=14)
    reader, watch = watched_reader(pool_bytes=POOL_BYTES)
    with reader:
        proc = senders.start(
            sender_spec(reader.address, samples, 14, "careful", connect_timeout_s=2.0),
            env={auth.SECRET_ENV: new_secret()},
        )
        res = finish_sender(proc, timeout=60)
        assert res["rc"] == 1 and res["finished"] == []
        assert set(res["failed"]) == {s["request_id"] for s in samples}
        for reason in res["failed"].values():
            assert "reader failed authentication" in reason, reason
        # (it may retry: each attempt says Hello, none gets further)
        assert calls["hello"] and set(calls["hello"]) == {"careful"}, (
            "the producer never talked to the reader"
        )
        # an Auth brings the producer's NIXL metadata, which the reader loads at once
        assert watch.peers_added == [], "the producer sent its Auth (and NIXL metadata) to an unproven reader"
        assert_no_sample(reader)
        assert pool_untouched(watch)
        # The same reader serves a producer without a secret (it requires none).
        run_honest_producer(reader, None, seed=15)


def test_the_reader_binds_loopback_by_default() -> None:
    with HiddenStatesReader(pool_bytes=1 << 20) as reader:
        host, port = parse_address(reader.address)
        assert host == "127.0.0.1" and port > 0
        # Another local interface's address does not reach it.
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent; picks the outbound address
            local = probe.getsockname()[0]
        except OSError:
            local = "127.0.0.1"
        finally:
            probe.close()
        if not local.startswith("127."):
            with pytest.raises(OSError):
                socket.create_connection((local, port), timeout=2).close()
        # Loopback does.
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "192.0.2.7:0"])
def test_a_reader_open_to_the_network_without_a_secret_refuses_to_start(
    listen: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match=r"without a shared secret.*KV_CONNECTOR_SECRET.*insecure"):
        HiddenStatesReader(listen=listen, pool_bytes=1 << 20)
    # the CLI says the same and exits 2, before it listens or makes anything on disk
    out = tmp_path / "never-made"
    res = subprocess.run(
        [sys.executable, "-m", "kv_connector.reader", "--listen", listen, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(NO_SECRET_ENV),
    )
    assert res.returncode == 2 and "--insecure" in res.stderr, res.stderr[-2000:]
    assert not out.exists()


def test_a_socket_handed_in_is_judged_by_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    with HiddenStatesReader(listen=held, pool_bytes=1 << 20) as reader:  # loopback: no secret needed
        assert reader.address.startswith("127.0.0.1:")


@pytest.mark.parametrize("where", ["env", "file"])
def test_an_empty_secret_is_an_error_not_no_secret(
    where: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    if where == "env":
        monkeypatch.setenv(auth.SECRET_ENV, "")
    else:
        (tmp_path / "s").write_text("\n")
        monkeypatch.setenv(auth.SECRET_FILE_ENV, str(tmp_path / "s"))
    with pytest.raises(ValueError, match="empty"):
        HiddenStatesReader(pool_bytes=1 << 20)
    with pytest.raises(ValueError, match="empty"):
        HiddenStatesSender(SenderConfig("127.0.0.1:9", "p"), make_cache(LAYOUT, 2, 0), LAYOUT, [0, 1, 2])


def test_the_secret_never_reaches_a_log(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level(logging.DEBUG)
    secret, wrong = new_secret(), new_secret()
    outputs: list[str] = []
    samples = plan("logged", [4, 20], seed=16)
    with HiddenStatesReader(pool_bytes=POOL_BYTES, secret=secret.encode()) as reader:
        procs = {
            "honest": start_logged_sender(
                sender_spec(reader.address, samples, 16, "logged-honest"), {auth.SECRET_ENV: secret}
            ),
            "wrong": start_logged_sender(
                sender_spec(reader.address, samples, 16, "logged-wrong", connect_timeout_s=2.0),
                {auth.SECRET_ENV: wrong},
            ),
            "none": start_logged_sender(
                sender_spec(reader.address, samples, 16, "logged-none", connect_timeout_s=2.0), NO_SECRET_ENV
            ),
        }
        try:
            got = collect(reader, len(samples))
            results = {k: finish_sender(p, timeout=60) for k, p in procs.items()}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.communicate()
        # A raw peer whose proof is made with the wrong secret: refused by the reader.
        peer = RawPeer(reader.address)
        try:
            nonce = peer.hello("logged-raw")
            ch = peer.recv()
            assert isinstance(ch, protocol.Challenge)
            proof = auth.proof(
                wrong.encode(), "producer", "logged-raw", 0, nonce, ch.nonce, auth.digest_of(b"")
            )
            peer.send(protocol.Auth(proof=proof, agent_metadata=b""))
            refusal = peer.expect_refused("authentication failed")
            outputs.append(refusal.message)
        finally:
            peer.close()
    check_samples(got, samples, seed=16)
    assert results["honest"]["rc"] == 0
    assert results["wrong"]["rc"] == 1 and results["none"]["rc"] == 1
    for res in results.values():
        outputs += [res["stderr"], json.dumps(res)]
    # The logs were really captured at DEBUG on both sides (so their silence means something).
    assert "handshake authenticated" in caplog.text and "logged-honest/rank0" in caplog.text
    assert "connected to reader" in results["honest"]["stderr"]
    assert "DEBUG" in results["honest"]["stderr"] or "INFO" in results["honest"]["stderr"]
    outputs.append(caplog.text)
    outputs += [r.getMessage() for r in caplog.records]
    outputs += [repr(r.args) for r in caplog.records]
    for s in (secret, wrong):
        forms = {s, repr(s.encode()), s.encode().hex(), s[7:]}
        for text in outputs:
            for form in forms:
                assert form not in text, "a shared secret appears in the logs"


@pytest.mark.parametrize("with_secret", [True, False], ids=["secret", "no-secret"])
@pytest.mark.parametrize(
    "first, then, match",
    [
        ("auth", None, "expected hello, got Auth"),
        ("credit_request", None, "expected hello, got CreditRequest"),
        ("hello", "credit_request", "expected auth, got CreditRequest"),
        ("hello", "hello", "expected auth, got Hello"),
    ],
)
def test_messages_out_of_handshake_order_are_refused(
    with_secret: bool, first: str, then: str | None, match: str, raw_peers: list[RawPeer]
) -> None:
    secret = b"order-secret" if with_secret else None
    manifest = protocol.Manifest(
        request_id="early",
        token_ids=token_ids("early", 20),
        layer_ids=list(range(LAYOUT.num_layers)),
        geometry=LAYOUT,
        num_blocks=2,
    )
    reader, watch = watched_reader(pool_bytes=POOL_BYTES, secret=secret)
    with reader:
        peer = RawPeer(reader.address)
        raw_peers.append(peer)

        def send(kind: str) -> None:
            if kind == "hello":
                peer.hello("out-of-order")
            elif kind == "auth":
                peer.send(protocol.Auth(proof=b"\x01" * 32, agent_metadata=b"not nixl metadata"))
            else:
                peer.send(protocol.CreditRequest(manifest=manifest, blocks=[0, 1]))

        send(first)
        if then is not None:
            ch = peer.recv()
            assert isinstance(ch, protocol.Challenge) and ch.auth_required is with_secret
            send(then)
        peer.expect_refused(match)
        assert reader.stats().refused == 1
        assert pool_untouched(watch)
        deliver_in_process(reader, secret, f"after-{first}-{then}")


@pytest.mark.parametrize(
    "kind",
    ["correct", "wrong-secret", "reflected", "other-rank", "replayed", "zeros", "unbound", "other-metadata"],
)
def test_only_a_fresh_proof_of_the_secret_is_accepted(kind: str, raw_peers: list[RawPeer]) -> None:
    secret = b"proof-secret"
    transport = Transport(f"proof-{kind}-{os.getpid()}")
    try:
        reader, watch = watched_reader(pool_bytes=POOL_BYTES, secret=secret)
        with reader:
            pid = f"proof-{kind}"
            agent = transport.name
            nonce = auth.make_nonce()
            bind = auth.digest_of(transport.metadata)  # the proof covers the metadata it brings
            world = 2 if kind == "other-rank" else 1
            captured = b""
            if kind == "replayed":
                # An earlier connection's exchange (same producer nonce) is observed and replayed.
                old = RawPeer(reader.address)
                raw_peers.append(old)
                old.send(hello_msg(pid, agent, nonce, world))
                old_ch = old.recv()
                assert isinstance(old_ch, protocol.Challenge)
                captured = auth.proof(secret, "producer", pid, 0, nonce, old_ch.nonce, bind)
                old.close()
            peer = RawPeer(reader.address)
            raw_peers.append(peer)
            peer.send(hello_msg(pid, agent, nonce, world))
            ch = peer.recv()
            assert isinstance(ch, protocol.Challenge) and ch.auth_required
            assert auth.verify(auth.proof(secret, "reader", pid, 0, nonce, ch.nonce), ch.proof)
            proof = {
                "correct": lambda: auth.proof(secret, "producer", pid, 0, nonce, ch.nonce, bind),
                "wrong-secret": lambda: auth.proof(
                    b"proof-secreT", "producer", pid, 0, nonce, ch.nonce, bind
                ),
                "reflected": lambda: ch.proof,
                "other-rank": lambda: auth.proof(secret, "producer", pid, 1, nonce, ch.nonce, bind),
                "replayed": lambda: captured,
                "zeros": lambda: bytes(32),
                # the proof of protocol v5 and before covered no metadata: a relay could swap it
                "unbound": lambda: auth.proof(secret, "producer", pid, 0, nonce, ch.nonce),
                "other-metadata": lambda: auth.proof(
                    secret, "producer", pid, 0, nonce, ch.nonce, auth.digest_of(b"the relay's metadata")
                ),
            }[kind]()
            peer.send(protocol.Auth(proof=proof, agent_metadata=transport.metadata))
            if kind == "correct":
                w = peer.recv()
                assert isinstance(w, protocol.Welcome) and w.agent_name == reader.reader_id
                assert reader.stats().refused == 0
            else:
                peer.expect_refused("authentication failed")
                assert reader.stats().refused == 1
            assert pool_untouched(watch)
            deliver_in_process(reader, secret, f"after-{kind}")
    finally:
        transport.close()


def hello_msg(pid: str, agent: str, nonce: bytes, world_size: int = 1) -> protocol.Hello:
    return protocol.Hello(
        version=protocol.PROTOCOL_VERSION,
        producer_id=pid,
        rank=0,
        world_size=world_size,
        agent_name=agent,
        block_bytes=LAYOUT.block_bytes,
        nonce=nonce,
    )
