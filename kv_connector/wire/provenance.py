"""What a sample says it is, and what a trainer expects it to be. Pure logic (no torch,
vllm or nixl).

A manifest already names its layer ids and its cache geometry (axis order, dtype, hidden
size); ``Provenance`` adds what produced it: the vLLM version, its model runner and the
model. ``Expectation`` is a trainer's side of the same: ``mismatches`` names every field
where a sample differs, and the consumer refuses such a sample before it hands out any
of its data. A checksum cannot see a wrong layer or model; this can.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated, NamedTuple, Protocol

import msgspec

from kv_connector.common.errors import ConfigurationError
from kv_connector.wire.layout import MAX_HIDDEN, MAX_LAYERS, DType

MAX_NAME_CHARS = 512


class ModelRunner(str, enum.Enum):
    """Which of vLLM's model runners captured the states."""

    # vllm/v1/worker/gpu_model_runner.py (and the CPU build's runner)
    V1 = "v1"
    # vllm/v1/worker/gpu/ (Model Runner V2)
    V2 = "v2"


Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]


class Provenance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What produced a sample (a wire record, nested in its manifest)."""

    vllm_version: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    model_runner: ModelRunner
    # the model as vLLM was given it: a hub id or a path
    model: Name
    revision: Annotated[str, msgspec.Meta(max_length=128)] | None = None

    def as_dict(self) -> dict[str, str]:
        """Flat strings, for file metadata."""
        out = {"vllm_version": self.vllm_version, "model_runner": self.model_runner.value}
        out["model"] = self.model
        if self.revision:
            out["revision"] = self.revision
        return out


class Described(Protocol):
    """What a sample says of itself: a manifest, or a sample a client handed out."""

    @property
    def layer_ids(self) -> Sequence[int]: ...

    @property
    def dtype(self) -> str: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def provenance(self) -> Provenance | None: ...


class Description(NamedTuple):
    """A ``Described`` built from a sample's parts (its tensor's dtype name and width)."""

    layer_ids: Sequence[int]
    dtype: str
    hidden_size: int
    provenance: Provenance | None


class Expectation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a trainer expects of every sample; a field left None accepts anything.

    ``model`` matches the producer's model name exactly or as its last path components
    (``Qwen/Qwen3-8B`` matches ``/models/Qwen/Qwen3-8B``)."""

    layer_ids: Annotated[list[int], msgspec.Meta(min_length=1, max_length=MAX_LAYERS)] | None = None
    dtype: DType | None = None
    hidden_size: Annotated[int, msgspec.Meta(gt=0, le=MAX_HIDDEN)] | None = None
    model: Name | None = None

    def __post_init__(self) -> None:
        if self.layer_ids is not None and len(set(self.layer_ids)) != len(self.layer_ids):
            raise ConfigurationError(f"expected layer ids repeat an id: {self.layer_ids}")

    def mismatches(self, manifest: Described) -> list[str]:
        """Each way the sample ``manifest`` describes differs from what is expected,
        named; [] when it is what is expected."""
        out: list[str] = []
        if self.layer_ids is not None and list(manifest.layer_ids) != self.layer_ids:
            out.append(f"layer ids {list(manifest.layer_ids)}, expected {self.layer_ids}")
        if self.dtype is not None and manifest.dtype != self.dtype:
            out.append(f"dtype {manifest.dtype}, expected {self.dtype}")
        if self.hidden_size is not None and manifest.hidden_size != self.hidden_size:
            out.append(f"hidden size {manifest.hidden_size}, expected {self.hidden_size}")
        if self.model is not None:
            got = manifest.provenance.model if manifest.provenance is not None else None
            if got is None:
                out.append(f"no model named by its producer, expected {self.model}")
            elif not model_matches(self.model, got):
                out.append(f"model {got}, expected {self.model}")
        return out


def model_matches(expected: str, got: str) -> bool:
    """Whether the producer's model name ``got`` is the ``expected`` one: the same, or
    ending in its path components."""
    want = expected.strip("/")
    return got == expected or got.rstrip("/").endswith("/" + want)
