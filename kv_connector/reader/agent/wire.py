"""What a rank's fetch agent and its clients say to each other over a Unix socket.

The agent is ``reader.agent.fetch_agent``, its clients ``reader.agent.client``. Each
message below travels as one length-prefixed msgpack frame.

    client                                   agent
    (connects)                          <-   AgentHello(pool_bytes), the pool's memory file
                                             attached (SCM_RIGHTS)
    AgentFetch(handle)                  ->
                                        <-   AgentSample(lease, where it lies in the pool)
                                             or AgentFailed(code, message)
    (copies the sample out of the pool)
    AgentDone(lease)                    ->   (no answer: the pages go back)
    AgentRelease(handle)                ->
                                        <-   AgentOk or AgentFailed
    AgentAsk()                          ->
                                        <-   AgentStats

A client's leases end with its connection, however it ends. The rank starts its agent
with one JSON line on the agent's standard input (``AgentConfig``). Pure: msgspec and bytes.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from kv_connector.reader.pull.links import FetchCode
from kv_connector.reader.pull.options import PullOptions
from kv_connector.wire.protocol import ProtocolError
from kv_connector.wire.provenance import Provenance

AGENT_VERSION = 1
# a sample's token ids and metadata, with room
MAX_AGENT_FRAME = 16 << 20
_LEN = struct.Struct(">I")


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the rank configures its agent, as the JSON line on standard input.

    It holds the options of the agent's ``PullClient``, where its socket lies and the secret."""

    socket_dir: str
    options: PullOptions
    # None: the client's default (KV_CONNECTOR_SECRET...)
    secret_hex: str | None = None
    # the rank's time.time() when it started the process
    spawned_at: float | None = None


class _AgentMsg(msgspec.Struct, tag_field="t", frozen=True):
    pass


class AgentHello(_AgentMsg, tag="hello", frozen=True):
    version: int
    pool_bytes: int
    agent_name: str
    pid: int


class AgentFetch(_AgentMsg, tag="fetch", frozen=True):
    handle: str
    # let the producer free the sample once it is read and checked
    release: bool = True


class AgentRelease(_AgentMsg, tag="release", frozen=True):
    handle: str


class AgentDone(_AgentMsg, tag="done", frozen=True):
    lease: int


class AgentAsk(_AgentMsg, tag="ask", frozen=True):
    pass


class AgentSample(_AgentMsg, tag="sample", frozen=True):
    lease: int
    request_id: str
    producer_id: str
    sample_id: str
    token_ids: list[int]
    layer_ids: list[int]
    metadata: dict[str, Any]
    # torch's name: "bfloat16", "float32", ...
    dtype: str
    # [T, L, H]
    shape: list[int]
    # in elements
    stride: list[int]
    # bytes from the pool's start to element [0, 0, 0]
    offset: int
    # what produced it (the manifest's)
    provenance: Provenance | None = None


class AgentFailed(_AgentMsg, tag="failed", frozen=True):
    code: FetchCode
    message: str


class AgentOk(_AgentMsg, tag="ok", frozen=True):
    pass


class AgentStats(_AgentMsg, tag="stats", frozen=True):
    """What one agent holds and did.

    It holds one NIXL agent (``agent_name``) and one registered pool (``registered_bytes``).
    It counts the clients connected now and the samples handed out and failed. It counts the
    leases held now and those freed because their client went away."""


    pid: int
    agent_name: str
    registered_bytes: int
    connections: int
    clients_seen: int
    fetched: int
    failed: int
    leases_held: int
    freed_by_disconnect: int


AgentMessage = (
    AgentHello
    | AgentFetch
    | AgentRelease
    | AgentDone
    | AgentAsk
    | AgentSample
    | AgentFailed
    | AgentOk
    | AgentStats
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AgentMessage)


def frame(msg: _AgentMsg) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Frames out of a byte stream, fed as it arrives."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next(self) -> AgentMessage | None:
        """The next whole message, or None until more bytes come; ``ValueError`` for a
        frame over the limit or a malformed one."""
        if len(self._buf) < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(self._buf)
        if n > MAX_AGENT_FRAME:
            raise ProtocolError(f"a frame of {n} bytes (at most {MAX_AGENT_FRAME})")
        if len(self._buf) < _LEN.size + n:
            return None
        body = bytes(self._buf[_LEN.size : _LEN.size + n])
        del self._buf[: _LEN.size + n]
        try:
            msg: AgentMessage = _decoder.decode(body)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"a malformed message: {e}") from None
        return msg


__all__ = [
    "AGENT_VERSION",
    "AgentAsk",
    "AgentConfig",
    "AgentDone",
    "AgentFailed",
    "AgentFetch",
    "AgentHello",
    "AgentMessage",
    "AgentOk",
    "AgentRelease",
    "AgentSample",
    "AgentStats",
    "FrameReader",
    "frame",
]
