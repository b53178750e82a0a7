"""What a finished request's ``kv_transfer_params["hidden_states"]`` says of its sample.

It is one record, built by the producer's scheduler side and read by clients (the datagen
driver, a trainer), so both ends agree on its keys and values. Pure logic."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from kv_connector.common.errors import ConfigurationError

# its key in a response's kv_transfer_params
PARAMS_KEY = "hidden_states"


class SampleStatus(str, enum.Enum):
    """Where a request's sample stands when the request finishes."""

    # its reader acknowledged it
    DELIVERED = "delivered"
    # on its way (a later failure is logged by the producer with its id)
    PENDING = "pending"
    # it will never arrive; ``error`` says why
    FAILED = "failed"
    # pull delivery: held in the producer's cache; fetch it by its ``handle``
    READY = "ready"


class OutcomeError(ConfigurationError):
    """A response carries no outcome, or one that is not well formed."""


class SampleOutcome(msgspec.Struct, frozen=True, omit_defaults=True):
    """One request's outcome, as its kv_transfer_params carry it.

    ``consumer_address``: the reader it was bound for. None in pull delivery, or when
    round robin had not picked one when it failed. ``sample_id``: the request's own id when
    it named none. ``delivery``: "pull" for a sample a consumer fetches by the handle beside
    this record; omitted for push."""

    status: SampleStatus
    producer_id: str
    request_id: str
    sample_id: str
    consumer_address: str | None
    error: str = ""
    delivery: Literal["push", "pull"] = "push"

    def params(self) -> dict[str, Any]:
        """Its place in ``kv_transfer_params``: ``{"hidden_states": {...}}``."""
        return {PARAMS_KEY: msgspec.to_builtins(self)}

    @classmethod
    def of(cls, kv_transfer_params: Mapping[str, Any] | None) -> SampleOutcome:
        """The outcome a response's ``kv_transfer_params`` carry; ``OutcomeError`` if none
        or malformed (unknown keys are ignored: a newer producer may add some)."""
        record = (kv_transfer_params or {}).get(PARAMS_KEY)
        if not isinstance(record, Mapping):
            raise OutcomeError(f"no kv_transfer_params.{PARAMS_KEY}")
        try:
            return msgspec.convert(record, cls)
        except msgspec.ValidationError as e:
            raise OutcomeError(f"kv_transfer_params.{PARAMS_KEY}: {e}") from None
