"""The wire protocol round-trips every message and refuses anything malformed with
ProtocolError (never another exception)."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_connector.wire import fields, protocol
from kv_connector.wire.layout import BlockLayout
from kv_connector.wire.protocol import ProtocolError

GEOMETRY = BlockLayout("LTH", 16, 3, 8, "float32")


def manifest(**kw: object) -> protocol.Manifest:
    base: dict[str, object] = dict(
        request_id="req-1",
        token_ids=list(range(20)),
        layer_ids=[1, 2, 3],
        geometry=GEOMETRY,
        num_blocks=2,
    )
    base.update(kw)
    return protocol.Manifest(**base)  # type: ignore[arg-type]


MESSAGES = [
    protocol.Hello(
        version=protocol.PROTOCOL_VERSION,
        producer_id="p",
        rank=0,
        world_size=2,
        agent_name="a",
        block_bytes=64,
        nonce=b"n" * 32,
    ),
    protocol.Challenge(
        version=protocol.PROTOCOL_VERSION, nonce=b"r" * 32, proof=b"d" * 32, auth_required=True
    ),
    protocol.Auth(proof=b"d" * 32, agent_metadata=b"\x00meta"),
    protocol.Welcome(
        reader_id="r",
        agent_name="ra",
        agent_metadata=b"m",
        pool_addr=1 << 40,
        pool_bytes=4096,
        page_bytes=1024,
        num_pages=4,
        mem_type="DRAM",
        device_id=0,
        proof=b"p" * 32,
    ),
    protocol.CreditRequest(manifest=manifest(), blocks=[1]),
    protocol.CreditRequest(manifest=manifest(sample_id="17", metadata=b'{"row":17,"src":"x"}'), blocks=[0]),
    protocol.Refuse(code="rejected", message="NaN in layer 2", request_id="req-1"),
    protocol.Grant(request_id="req-1", first_page=3, num_pages=2, generation=7),
    protocol.Ack(request_id="req-1"),
    protocol.Refuse(code="checksum", message="no", request_id="req-1"),
    protocol.WriteDone(request_id="req-1", generation=1),
    protocol.WriteDone(request_id="req-1", generation=(1 << 63) - 1, checksum=(1 << 64) - 1),
    protocol.WriteDone(request_id="req-1", generation=2, checksum_follows=True),
    protocol.Fenced(request_id="req-1", generation=3),
    protocol.LateChecksum(request_id="req-1", checksum=5),
    protocol.Rewrite(request_id="req-1", reason="checksum"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: protocol._Msg) -> None:
    assert protocol.decode(protocol.encode(msg)) == msg


def raw(d: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode(d)


def hello_dict(**kw: object) -> dict[str, object]:
    d: dict[str, object] = dict(
        type="hello",
        version=protocol.PROTOCOL_VERSION,
        producer_id="p",
        rank=0,
        world_size=1,
        agent_name="a",
        block_bytes=64,
        nonce=b"n" * 32,
    )
    d.update(kw)
    return d


@pytest.mark.parametrize(
    "payload, fragment",
    [
        (hello_dict(version=1), "version 1"),
        (hello_dict(version=protocol.PROTOCOL_VERSION + 1), f"version {protocol.PROTOCOL_VERSION + 1}"),
        (hello_dict(extra=1), "unknown field"),
        (hello_dict(rank="0"), "Expected `int`"),
        (hello_dict(rank=-1), ">= 0"),
        (hello_dict(world_size=0), ">= 1"),
        (hello_dict(nonce=b"short"), "length"),
        (hello_dict(producer_id="x" * 300), "matching regex"),
        (hello_dict(producer_id="a\tb"), "matching regex"),
        (hello_dict(producer_id="victim\nreq-1"), "matching regex"),
        (hello_dict(producer_id="p\n"), "matching regex"),
        (hello_dict(agent_name="../a"), "matching regex"),
        (hello_dict(cache_mem="SSD"), "Invalid"),
        (hello_dict(type="nope"), "Invalid value 'nope'"),
        ({"version": 1}, "missing required field `type`"),
    ],
)
def test_bad_hello_is_refused(payload: dict[str, object], fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        protocol.decode(raw(payload))


def credit(m: dict[str, object], blocks: list[int], geometry: dict[str, object] | None = None) -> bytes:
    good = msgspec.to_builtins(manifest())
    good["metadata"] = b""  # to_builtins makes bytes base64 text; msgpack carries them as bin
    good.update(m)
    good["geometry"].update(geometry or {})
    return raw({"type": "credit_request", "manifest": good, "blocks": blocks})


@pytest.mark.parametrize(
    "change, blocks, fragment",
    [
        ({"num_blocks": 3}, [0], "need 2 blocks"),
        ({"layer_ids": [1, 2]}, [0], "2 layer ids for blocks of 3 layers"),
        ({"block_bytes": 100}, [0], "unknown field"),
        ({}, [2], "outside"),
        ({}, [0, 0], "duplicate"),
        ({"request_id": "../etc/passwd"}, [0], "matching regex"),
        ({"token_ids": []}, [0], "length"),
        ({"token_ids": [-1]}, [0], ">= 0"),
        ({"sample_id": "a b"}, [0], "matching regex"),
        ({"sample_id": "../x"}, [0], "matching regex"),
        ({"sample_id": "x" * 129}, [0], "matching regex"),
        ({"sample_id": "17" + chr(10)}, [0], "matching regex"),
        ({"sample_id": 17}, [0], "Expected `str | null`"),
        ({"metadata": b"x" * 4097}, [0], "length"),
        ({"metadata": b"{"}, [0], "not JSON"),
        ({"metadata": b"[1]"}, [0], "not a JSON object"),
        ({"metadata": b"[" * 4000 + b"]" * 96}, [0], "not JSON"),
    ],
)
def test_bad_manifest_is_refused(change: dict[str, object], blocks: list[int], fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        protocol.decode(credit(change, blocks))


@pytest.mark.parametrize(
    "geometry, fragment",
    [
        ({"layout": "XYZ"}, "Invalid enum value 'XYZ'"),
        ({"dtype": "int7"}, "Invalid enum value 'int7'"),
        ({"block_size": 0}, ">= 1"),
        ({"hidden_size": 1 << 21}, "<= 1048576"),
        ({"num_layers": 2}, "3 layer ids for blocks of 2 layers"),
    ],
)
def test_a_bad_geometry_is_refused_by_decoding(geometry: dict[str, object], fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        protocol.decode(credit({}, [0], geometry))


def test_a_geometry_built_in_python_is_checked_too() -> None:
    with pytest.raises(ValueError, match="layout"):
        BlockLayout("XYZ", 16, 3, 8, "float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="need 2 blocks"):
        manifest(num_blocks=3)


@pytest.mark.parametrize("code", ["x", "", "protocol "])
def test_a_refusal_code_is_one_of_the_known_kinds(code: str) -> None:
    with pytest.raises(ProtocolError, match="Invalid enum value"):
        protocol.decode(raw({"type": "refuse", "code": code, "message": "m"}))


@pytest.mark.parametrize("rid", ["ok" + chr(10), "a b", "a/b", "x" * 257, ""])
def test_request_ids_outside_the_pattern_are_refused(rid: str) -> None:
    with pytest.raises(ProtocolError, match=r"regex|length"):
        protocol.decode(raw({"type": "ack", "request_id": rid}))


def test_oversize_message_is_refused() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(b"\x00" * (fields.MAX_FRAME_BYTES + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        protocol.decode(data)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(MESSAGES), st.data())
def test_truncated_messages_raise_only_protocol_error(msg: protocol._Msg, data: st.DataObject) -> None:
    enc = protocol.encode(msg)
    cut = data.draw(st.integers(0, len(enc) - 1))
    with pytest.raises(ProtocolError):
        protocol.decode(enc[:cut])


@pytest.mark.parametrize("checksum", [-1, "abc", 1.5, [1]])
def test_write_done_checksum_out_of_range_is_refused(checksum: object) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode(raw({"type": "write_done", "request_id": "r", "generation": 1, "checksum": checksum}))


@pytest.mark.parametrize("generation", [None, 0, -1, 1 << 63, "1"])
def test_a_write_done_names_a_grant_that_could_exist(generation: object) -> None:
    fields = {"type": "write_done", "request_id": "r", "generation": generation}
    with pytest.raises(ProtocolError):
        protocol.decode(raw({k: v for k, v in fields.items() if v is not None}))


def test_a_write_done_with_a_checksum_has_no_digest_to_follow() -> None:
    with pytest.raises(ProtocolError, match="no checksum to follow"):
        fields = {"request_id": "r", "generation": 1, "checksum": 1, "checksum_follows": True}
        protocol.decode(raw({"type": "write_done", **fields}))


@pytest.mark.parametrize("first, n", [(-1, 1), (0, 0), (fields.MAX_PAGES, 1)])
def test_a_grant_outside_the_page_range_is_refused(first: int, n: int) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode(raw({"type": "grant", "request_id": "r", "first_page": first, "num_pages": n}))


def welcome_dict(**kw: object) -> dict[str, object]:
    d: dict[str, object] = {"type": "welcome", **msgspec.structs.asdict(MESSAGES[3])}
    d.update(kw)
    return d


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"pool_addr": (1 << 64) - 1}, "64-bit"),  # a valid uint64 that overflowed the transport
        ({"num_pages": 5}, "do not fit"),
        ({"page_bytes": 8192}, "do not fit"),
        ({"proof": b"short"}, "length"),
        ({"proof": None}, "Expected `bytes`"),
    ],
)
def test_a_welcome_that_does_not_add_up_is_refused_before_anyone_uses_it(
    fields: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        protocol.decode(raw(welcome_dict(**fields)))


@pytest.mark.parametrize(
    "rid",
    ["has space", "a/b", "x" * 257, "trailing-newline\n", "", "tab\there", "ünïcode"],
)
def test_request_ids_that_cannot_name_a_sample_are_named_and_refused_on_the_wire(rid: str) -> None:
    why = protocol.request_id_problem(rid)
    assert why is not None and "cannot name a sample" in why
    with pytest.raises(ProtocolError):
        protocol.decode(raw({"type": "ack", "request_id": rid}))


@pytest.mark.parametrize("rid", ["cmpl-1a2b-0", "x" * 256, "a.b:c@d+e=f_g-h"])
def test_request_ids_that_can_travel_pass(rid: str) -> None:
    assert protocol.request_id_problem(rid) is None
    assert protocol.decode(raw({"type": "ack", "request_id": rid})) == protocol.Ack(request_id=rid)


def test_the_new_refuse_codes_travel() -> None:
    for code in ("timeout", "limit", "preempted", "unchecked"):
        msg = protocol.Refuse(code=code, message="m", request_id="r")  # type: ignore[arg-type]
        assert protocol.decode(protocol.encode(msg)) == msg


def test_a_pull_share_says_which_checksum_it_carries() -> None:
    """``PullShare.checksum_kind`` names the kind of its checksum (version 10, so named in
    17); a share from an older build, without it, reads as XXH3; an unknown kind is
    refused by decoding."""
    share = protocol.PullShare(
        manifest=manifest(), rank=0, world_size=1, first_block=0, block_ids=[3, 5], cache_addr=4096,
        cache_bytes=8 * GEOMETRY.block_bytes, mem_type="VRAM", device_id=1, checksum=(1 << 64) - 1,
        checksum_kind=protocol.ShareChecksum.BLOCKS,
    )  # fmt: skip
    back = protocol.decode(protocol.encode(share))
    assert back == share and isinstance(back, protocol.PullShare)
    assert back.checksum_kind is protocol.ShareChecksum.BLOCKS
    fields = msgspec.msgpack.decode(protocol.encode(share))
    assert fields["checksum_kind"] == "blocks"
    del fields["checksum_kind"]
    older = protocol.decode(msgspec.msgpack.encode(fields))
    assert isinstance(older, protocol.PullShare) and older.checksum_kind is protocol.ShareChecksum.XXH3
    with pytest.raises(ProtocolError, match="checksum_kind"):
        protocol.decode(msgspec.msgpack.encode({**fields, "checksum_kind": "md5"}))
    fp = protocol.decode(msgspec.msgpack.encode({**fields, "checksum_kind": "fingerprint"}))
    assert isinstance(fp, protocol.PullShare) and fp.checksum_kind is protocol.ShareChecksum.FINGERPRINT
    assert protocol.PROTOCOL_VERSION == 17


def test_a_pull_share_in_padded_pages_says_its_pitch_and_blocks_must_fit_it() -> None:
    """``PullShare.block_pitch`` (version 11): blocks ``pitch`` bytes apart in the producer's
    registered memory; without it, one block; a pitch shorter than a block, or a block
    whose page runs past the cache, is refused by decoding."""
    bb = GEOMETRY.block_bytes
    kw = dict(manifest=manifest(), rank=0, world_size=1, first_block=0, block_ids=[3, 5], cache_addr=4096,
              mem_type="DRAM", device_id=0)  # fmt: skip
    share = protocol.PullShare(cache_bytes=5 * (bb + 64) + bb, block_pitch=bb + 64, **kw)  # type: ignore[arg-type]
    back = protocol.decode(protocol.encode(share))
    assert back == share and isinstance(back, protocol.PullShare) and back.pitch == bb + 64
    assert protocol.PullShare(cache_bytes=6 * bb, **kw).pitch == bb  # type: ignore[arg-type]
    for pitch, size in ((bb - 8, 10 * bb), (bb + 64, 5 * (bb + 64) + bb - 1)):
        with pytest.raises((ValueError, ProtocolError)):
            protocol.decode(protocol.encode(protocol.PullShare(cache_bytes=size, block_pitch=pitch, **kw)))  # type: ignore[arg-type]


def test_credits_ahead_messages_round_trip_and_refuse_what_does_not_fit() -> None:
    m = manifest()
    msgs: list[protocol._Msg] = [
        protocol.Credit(generation=3, first_page=4, num_pages=2),
        protocol.Placed(manifest=m, blocks=list(range(m.num_blocks)), generation=3),
        protocol.CreditRecall(generation=3),
        protocol.CreditReturned(generation=3),
    ]
    for msg in msgs:
        assert protocol.decode(protocol.encode(msg)) == msg
    assert protocol.Credit(generation=3, first_page=4, num_pages=2).pages == range(4, 6)
    placed = msgspec.msgpack.decode(protocol.encode(msgs[1]))
    with pytest.raises(ProtocolError, match="written whole"):  # a producer of one rank writes it all
        protocol.decode(msgspec.msgpack.encode({**placed, "blocks": [0]}))
    with pytest.raises(ProtocolError):
        protocol.decode(
            msgspec.msgpack.encode({**msgspec.msgpack.decode(protocol.encode(msgs[0])), "num_pages": 0})
        )
    h = msgspec.msgpack.decode(protocol.encode(MESSAGES[0]))  # a Hello
    assert protocol.decode(msgspec.msgpack.encode(h)).credits_ahead == 0  # type: ignore[union-attr]
    with pytest.raises(ProtocolError):
        protocol.decode(msgspec.msgpack.encode({**h, "credits_ahead": protocol.MAX_CREDITS_AHEAD + 1}))
