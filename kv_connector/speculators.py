"""speculators' hidden-states backend "kv-hidden-states": online training from a vLLM
producer in pull delivery, no file system and no store between them.

``import kv_connector.speculators`` registers the backend in
``hs_connectors.HiddenStatesBackend.registry`` (importing it again is harmless);
``python -m kv_connector.speculators ARGS...`` runs speculators' own CLI with it
registered (speculators reads the registry when its config module is imported), e.g.
``python -m kv_connector.speculators train --hidden-states-backend kv-hidden-states ...``.

Each DataLoader worker gets the transfer (``KvHiddenStatesTransfer``) pickled; its
``PullClient`` makes its NIXL agent and receive pool on first use. ``get_generated``
fetches the row's sample by the ``handle`` in the server's ``kv_transfer_params``,
READing it from the producer's cache, checks it, releases it at the producer, and
returns what speculators' ``FileTransfer`` loads from ``hs_<i>.safetensors``: ``token_ids``
int64 [T] and ``hidden_states`` [T, L, H] in the producer's dtype. ``delete(handle)``
releases (a sample ``get_generated`` returned is released already: nothing to do).

The only module that imports speculators' packages; it is optional (the rest of
kv_connector never needs it).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from hs_connectors.transfer import HiddenStatesBackend, HiddenStatesTransfer

from kv_connector.reader.pull import FetchError, PullClient, handle_of

BACKEND = "kv-hidden-states"
DEFAULT_POOL_MIB = 256
DEFAULT_FETCH_TIMEOUT_S = 60.0
DEFAULT_PULL_LISTEN = "127.0.0.1"
DEFAULT_PULL_TIMEOUT_S = 300.0
MAX_REMEMBERED = 4096  # handles released by get_generated, remembered for delete()


class KvHiddenStatesTransfer(HiddenStatesTransfer):
    """One trainer process's (or DataLoader worker's) side: fetches pulled samples."""

    def __init__(
        self, pool_mib: int = DEFAULT_POOL_MIB, fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    ) -> None:
        self.client = PullClient(pool_bytes=pool_mib << 20, timeout_s=fetch_timeout_s, copy=True)
        self._released: set[str] = set()  # by get_generated: delete() need not ask the producer

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        return None  # nothing is stored: every row is generated

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """``token_ids`` int64 [T] and ``hidden_states`` [T, L, H] (the producer's dtype,
        contiguous) of the sample the server's ``kv_transfer_params`` name; raises
        ``FetchError`` saying why not (speculators retries the row)."""
        sample = self.client.fetch(hs_transfer_params)
        if len(self._released) >= MAX_REMEMBERED:
            self._released.clear()  # forgotten ones are only released once more (harmless)
        self._released.add(handle_of(hs_transfer_params))
        return {"token_ids": sample.token_ids, "hidden_states": sample.hidden_states}

    def delete(self, handle: str) -> None:
        if handle in self._released:  # released when it was fetched: no round trip
            self._released.discard(handle)
            return
        self.client.release(handle)


def _add(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """Add ``flag`` unless the parser has its destination already (the launcher and the
    trainer may both ask)."""
    dest = flag.lstrip("-").replace("-", "_")
    if not any(a.dest == dest for a in parser._actions):
        parser.add_argument(flag, **kwargs)


class KvHiddenStatesBackend(HiddenStatesBackend):
    """Pull delivery from HiddenStatesConnector (``kv_connector.connector``)."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        _add(parser, "--kv-hs-pool-mib", type=int, default=DEFAULT_POOL_MIB,
             help="each DataLoader worker's receive pool, in MiB (a row must fit)")  # fmt: skip
        _add(parser, "--kv-hs-fetch-timeout-s", type=float, default=DEFAULT_FETCH_TIMEOUT_S,
             help="how long one row's fetch may take")  # fmt: skip

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        _add(parser, "--kv-hs-pull-listen", default=DEFAULT_PULL_LISTEN,
             help="where each vLLM rank serves its samples, HOST or HOST:PORT (a non-loopback "
                  "address needs KV_CONNECTOR_SECRET on both ends)")  # fmt: skip
        _add(parser, "--kv-hs-pull-timeout-s", type=float, default=DEFAULT_PULL_TIMEOUT_S,
             help="a sample not released by then is freed (a fetch then fails 'expired')")  # fmt: skip

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> KvHiddenStatesTransfer:
        return KvHiddenStatesTransfer(
            pool_mib=int(getattr(args, "kv_hs_pool_mib", DEFAULT_POOL_MIB)),
            fetch_timeout_s=float(getattr(args, "kv_hs_fetch_timeout_s", DEFAULT_FETCH_TIMEOUT_S)),
        )

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        return {
            "kv_connector": "HiddenStatesConnector",
            "kv_connector_module_path": "kv_connector.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "delivery": "pull",
                "pull_listen": str(getattr(args, "kv_hs_pull_listen", DEFAULT_PULL_LISTEN)),
                "pull_timeout_s": float(getattr(args, "kv_hs_pull_timeout_s", DEFAULT_PULL_TIMEOUT_S)),
            },
        }


def register() -> None:
    """Register the backend under ``BACKEND`` (once: a second call does nothing)."""
    if BACKEND not in HiddenStatesBackend.registry:
        HiddenStatesBackend.register(BACKEND)(KvHiddenStatesBackend)


if __name__ != "__main__":  # run as a program, main() registers the importable module's classes
    register()

__all__ = ["BACKEND", "FetchError", "KvHiddenStatesBackend", "KvHiddenStatesTransfer", "register"]


def main(argv: list[str] | None = None) -> None:
    """speculators' own CLI, with this backend registered."""
    import kv_connector.speculators as registered  # under its own name, whatever runs it

    registered.register()
    from speculators.__main__ import app

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    app()


if __name__ == "__main__":
    main()
