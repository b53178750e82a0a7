"""The wire's field types and their bounds: every number, name and byte string a peer may
send is one of these ``Annotated`` types, so msgspec's decoding rejects a value out of
range before any code sees it (``wire.protocol``'s messages are built of them). Bounds
must fit msgpack's int64 where they are signed. Pure: msgspec only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_FRAME_BYTES = 64 << 20
MAX_TOKENS = 1 << 22
MAX_RANKS = 1024
MAX_BLOCKS = 1 << 22
MAX_PAGES = 1 << 24
# NIXL's agent metadata is about 1 KiB
MAX_METADATA_BYTES = 64 << 10
MAX_SAMPLE_ID_CHARS = 128
MAX_SAMPLE_METADATA_BYTES = 4096
# a Refuse's message, a Rewrite's reason
MAX_TEXT_CHARS = 4096

SAMPLE_ID_PATTERN = r"^[A-Za-z0-9_.:@+=\-]{1,128}\Z"

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# names that end up in logs, ledgers and file names: a safe character set (\Z, not $:
# "$" also matches before a trailing newline)
SafeName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:@+=\-]{1,128}\Z")]
# \Z, not $: "$" also matches before a trailing newline
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_.:@+=\-]{1,256}\Z"
RequestId = Annotated[str, msgspec.Meta(pattern=REQUEST_ID_PATTERN)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
WorldSize = Annotated[int, msgspec.Meta(gt=0, le=MAX_RANKS)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Proof = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Metadata = Annotated[bytes, msgspec.Meta(max_length=MAX_METADATA_BYTES)]
BlockIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_BLOCKS)]
PageIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_PAGES)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
LayerId = Annotated[int, msgspec.Meta(ge=-1, lt=1 << 16)]
# msgpack ints stop at 2**64 - 1
Checksum = Annotated[int, msgspec.Meta(ge=0)]
SampleId = Annotated[str, msgspec.Meta(pattern=SAMPLE_ID_PATTERN)]
SampleMetadata = Annotated[bytes, msgspec.Meta(max_length=MAX_SAMPLE_METADATA_BYTES)]
# one grant of pages (push's fence)
Generation = Annotated[int, msgspec.Meta(gt=0, le=(1 << 63) - 1)]


def clip_text(text: str) -> str:
    """``text`` cut to what a message's free-text field holds (``MAX_TEXT_CHARS``)."""
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 3] + "..."
