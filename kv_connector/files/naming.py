"""Where the reader CLI writes a sample: the file layouts, and file names derived safely
from ids a peer chose.

Pure logic (standard library only). Every name is one path component of bounded length:
no separator, never ``.`` or ``..``, never hidden (the CLI's own ``.tmp/`` and
``.delivered`` start with a dot), at most ``MAX_NAME`` characters before its suffix. An id
that is already such a name is used as it is; any other (a character outside
``[A-Za-z0-9_.@+=-]``, a leading dot, or too long) becomes a readable prefix, ``~`` and a
128-bit hash of the whole id. ``~`` never appears in a name used as it is, so two
different ids never get the same name.

Layouts (``FileLayout``):
  default      ``OUT/<producer_id>/<request_id>.safetensors``: two producers with the same
               request id never collide.
  speculators  ``OUT/hs_<sample_id>.safetensors`` for a sample id that is a decimal row
               index (``0``, ``17``; not ``017``), what speculators' ``ArrowDataset`` loads
               by row; any other sample goes to
               ``OUT/unnamed/<producer_id>/<sample_id>.safetensors`` (the sample id being
               the request id when none was given), kept but not read by speculators.
"""

from __future__ import annotations

import enum
import hashlib
import re
from pathlib import PurePosixPath

# characters of a name used as it is (+ ".safetensors": far below NAME_MAX 255)
MAX_NAME = 100
# characters of an id kept in front of its hash
PREFIX = 64
SUFFIX = ".safetensors"
UNNAMED = "unnamed"

_PLAIN = re.compile(rf"[A-Za-z0-9_@+=\-][A-Za-z0-9_.@+=\-]{{0,{MAX_NAME - 1}}}\Z")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.@+=\-]")
_ROW = re.compile(r"(0|[1-9][0-9]{0,29})\Z")


class FileLayout(str, enum.Enum):
    DEFAULT = "default"
    SPECULATORS = "speculators"


def safe_name(ident: str) -> str:
    """A file-name component for ``ident``: itself when it is a plain, short name, else a
    readable prefix, ``~`` and a hash of the whole id (distinct ids, distinct names)."""
    if _PLAIN.match(ident):
        return ident
    prefix = _UNSAFE.sub("_", ident)[:PREFIX].lstrip(".") or "_"
    return f"{prefix}~{hashlib.sha256(ident.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}"


def row_index(sample_id: str) -> int | None:
    """The dataset row a sample id names (a decimal integer written without leading
    zeros), else None."""
    return int(sample_id) if _ROW.match(sample_id) else None


def sample_path(layout: FileLayout, producer_id: str, request_id: str, sample_id: str) -> PurePosixPath:
    """The sample's file, relative to the output directory (see the module docstring)."""
    if layout is FileLayout.SPECULATORS:
        row = row_index(sample_id)
        if row is not None:
            return PurePosixPath(f"hs_{row}{SUFFIX}")
        return PurePosixPath(UNNAMED, safe_name(producer_id), safe_name(sample_id) + SUFFIX)
    return PurePosixPath(safe_name(producer_id), safe_name(request_id) + SUFFIX)
