"""speculators' hidden-states backend "kv-hidden-states": online training from a vLLM
producer in pull delivery, no file system and no store between them.

``import kv_connector.speculators`` registers the backend in
``hs_connectors.HiddenStatesBackend.registry`` (importing it again is harmless);
``python -m kv_connector.speculators ARGS...`` runs speculators' own CLI with it
registered (speculators reads the registry when its config module is imported), e.g.
``python -m kv_connector.speculators train --hidden-states-backend kv-hidden-states ...``.

Where the fetching happens (``--kv-hs-fetch-agent``, ``FetchMode``):

- ``rank`` (the default): one fetch agent per trainer rank (``reader.agent.fetch_agent``), a
  process the rank starts when the transfer is first pickled into its DataLoader's
  workers (or first used): the rank's only NIXL agent and only registered pool. Each
  worker gets the agent's address pickled, maps the agent's pool, and copies each row
  out of it once; the agent READs, checks and releases. A worker that dies has its
  leases freed; the agent ends with the rank.
- ``worker``: each DataLoader worker makes a ``PullClient`` of its own (its own NIXL
  agent and pool) on first use.

``get_generated`` fetches the row's sample by the ``handle`` in the server's
``kv_transfer_params``, READing it from the producer's cache, checks it, releases it at
the producer, and returns what speculators' ``FileTransfer`` loads from
``hs_<i>.safetensors``: ``token_ids`` int64 [T] and ``hidden_states`` [T, L, H] in the
producer's dtype. ``delete(handle)`` releases (a sample ``get_generated`` returned is
released already: nothing to do).

Capture once, train many (``--kv-hs-keep DIR``): ``get_cached`` reads a row from DIR
(``files.keep``, verified), and a row it did not find is kept there once
``get_generated`` fetched it, behind the hand-out; later epochs ask vLLM only for rows
not kept, and speculators' file backend trains other drafters from DIR.

``--kv-hs-sampler rank-kept`` keeps each trainer rank's rows across epochs
(``files.rank_sampler``; speculators' own sampler reshuffles rows across ranks, so a row
kept on one node is asked of another the next epoch): ``from_train_args`` puts it in the
place of speculators' sampler in ``speculators.train.dataloader``, where its loaders are
built, before the trainer builds them; ``use_sampler`` does the same for code that calls
``create_train_val_loaders`` itself.

The only module that imports speculators' packages; it is optional (the rest of
kv_connector never needs it).
"""

from __future__ import annotations

import argparse
import enum
import json
import multiprocessing.util
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
import torch
from hs_connectors.transfer import HiddenStatesBackend, HiddenStatesTransfer

from kv_connector.common.errors import ConfigurationError
from kv_connector.files.fp8 import Fp8Scale
from kv_connector.files.keep import RowStore, claim_folder
from kv_connector.files.rank_sampler import RankKeptBatchSampler
from kv_connector.reader import (
    AGENT_POOL_BYTES,
    DEFAULT_POOL_BYTES,
    AgentClient,
    FetchAgentError,
    FetchAgentProcess,
    FetchError,
    PullClient,
    handle_of,
)
from kv_connector.reader.pull.options import FETCH_TIMEOUT_S
from kv_connector.wire.provenance import Expectation

BACKEND = "kv-hidden-states"
# each worker's, in worker mode
DEFAULT_POOL_MIB = DEFAULT_POOL_BYTES >> 20
# the rank's one pool, in rank mode
DEFAULT_RANK_POOL_MIB = AGENT_POOL_BYTES >> 20
DEFAULT_FETCH_TIMEOUT_S = FETCH_TIMEOUT_S
DEFAULT_PULL_LISTEN = "127.0.0.1"
DEFAULT_PULL_TIMEOUT_S = 300.0
# handles released by get_generated, remembered for delete()
MAX_REMEMBERED = 4096


class FetchMode(enum.Enum):
    """Where a trainer rank's rows are fetched."""

    # one fetch agent (one NIXL agent, one pool) shared by the rank's workers
    RANK = "rank"
    # a PullClient (a NIXL agent and a pool) in each DataLoader worker
    WORKER = "worker"


class SamplerKind(enum.Enum):
    """Which batch sampler speculators' loaders use."""

    # its own: every row reshuffled across ranks each epoch
    SPECULATORS = "speculators"
    # each rank's rows fixed by seed, shuffled within it (files.rank_sampler)
    RANK_KEPT = "rank-kept"


# speculators' own class, once replaced
_SPECULATORS_SAMPLER: dict[str, Any] = {}


def use_sampler(kind: SamplerKind | str) -> None:
    """Make speculators' loaders built from now on in this process use ``kind``'s sampler:
    the name ``speculators.train.dataloader`` builds its sampler from (the only place it
    chooses one) is pointed at ours, or back at its own."""
    kind = SamplerKind(kind)
    if kind is SamplerKind.SPECULATORS and not _SPECULATORS_SAMPLER:
        # never replaced: nothing to import or undo
        return
    import speculators.train.dataloader as loaders

    _SPECULATORS_SAMPLER.setdefault("cls", loaders.MultipackDistributedBatchSamplerV2)
    chosen = RankKeptBatchSampler if kind is SamplerKind.RANK_KEPT else _SPECULATORS_SAMPLER["cls"]
    loaders.MultipackDistributedBatchSamplerV2 = chosen  # type: ignore[misc]


def agent_name(mode: FetchMode) -> str:
    """The NIXL agent's name, as producers log the consumers they serve: the mode and the
    pid of the process that made it (the rank's, for its fetch agent; a worker's)."""
    return f"kvhs-{mode.value}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class KvHiddenStatesTransfer(HiddenStatesTransfer):
    """One trainer rank's side (and, pickled, each DataLoader worker's): fetches pulled
    samples, through the rank's fetch agent or a client of the worker's own (``mode``).
    ``pool_mib``: the rank agent's pool, or each worker's (default: 1024 and 256)."""

    def __init__(
        self,
        pool_mib: int | None = None,
        fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
        mode: FetchMode | str = FetchMode.RANK,
        agent_address: str | None = None,
        expect: Expectation | dict[str, Any] | None = None,
        keep: str | None = None,
        keep_gib: float | None = None,
        keep_fp8: str | None = None,
    ) -> None:
        self.mode = FetchMode(mode)
        # capture once, train many: each fetched row kept in this folder (``files.keep``)
        self.keep, self.keep_gib = keep, keep_gib
        self.keep_fp8 = Fp8Scale(keep_fp8) if keep_fp8 is not None else None
        if keep_gib is not None and keep_gib <= 0:
            raise ConfigurationError(f"--kv-hs-keep-gib must be positive, got {keep_gib}")
        self._store: RowStore | None = None
        # the row get_cached did not find, which get_generated fetches (and keeps)
        self.missed: int | None = None
        # what every row must be (layer ids, model): a row that is not fails by name
        self.expect = msgspec.convert(expect, Expectation) if isinstance(expect, dict) else expect
        # keeps rows unless it reads some of the folder's layers (its rows would have fewer)
        self.keeps = True
        # refused at once where the folder keeps another run's rows
        if keep is not None:
            mine = self.keep_describes()
            theirs = claim_folder(keep, mine)
            self.keeps = theirs.get("layer_ids", mine.get("layer_ids")) == mine.get("layer_ids")
        default = DEFAULT_RANK_POOL_MIB if self.mode is FetchMode.RANK else DEFAULT_POOL_MIB
        self.pool_mib = pool_mib if pool_mib is not None else default
        if self.pool_mib < 1:
            raise ConfigurationError(f"pool_mib must be at least 1, got {self.pool_mib}")
        self.fetch_timeout_s = fetch_timeout_s
        # the rank's, in the process that started it
        self.agent: FetchAgentProcess | None = None
        self._address = agent_address
        self._client: PullClient | AgentClient | None = None
        # by get_generated: delete() need not ask the producer
        self._released: set[str] = set()

    def keep_describes(self) -> dict[str, str]:
        """What this run's kept rows are (``files.keep.claim_folder``): the layout, and the
        model and layer ids the trainer expects, where it knows them."""
        out = {"layout": f"fp8-{self.keep_fp8.value}" if self.keep_fp8 is not None else "safetensors"}
        if self.expect is not None and self.expect.model is not None:
            out["model"] = self.expect.model
        if self.expect is not None and self.expect.layer_ids is not None:
            out["layer_ids"] = ",".join(map(str, self.expect.layer_ids))
        return out

    @property
    def agent_address(self) -> str:
        """The rank's fetch agent's address (the agent is started now if it is not yet)."""
        return self._start_agent()

    def _start_agent(self, keep: list[dict[str, Any]] | None = None) -> str:
        """Start the rank's fetch agent, if it is not; the samples of ``keep`` (this rank's
        first rows) stay held at their producers while it starts."""
        if self._address is None:
            if self.agent is None:
                self.agent = FetchAgentProcess(
                    pool_bytes=self.pool_mib << 20,
                    timeout_s=self.fetch_timeout_s,
                    name=agent_name(self.mode),
                    # checked before the row is READ, as a worker's client does
                    expect=self.expect,
                )
            try:
                self.agent.start(keep=keep or [])
            except FetchAgentError as e:
                raise FetchError("agent", f"the rank's fetch agent did not start: {e}") from None
            self._address = self.agent.address
        return self._address

    @property
    def client(self) -> PullClient | AgentClient:
        """What fetches in this process (made on first use)."""
        if self._client is None:
            if self.mode is FetchMode.WORKER:
                self._client = PullClient(
                    pool_bytes=self.pool_mib << 20,
                    timeout_s=self.fetch_timeout_s,
                    copy=True,
                    name=agent_name(self.mode),
                    # checked before the row is READ
                    expect=self.expect,
                )
            else:
                self._client = AgentClient(self.agent_address, timeout_s=self.fetch_timeout_s)
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        # into a DataLoader worker: in rank mode the agent's address (started now, once)
        address = self.agent_address if self.mode is FetchMode.RANK else None
        return {
            "pool_mib": self.pool_mib,
            "fetch_timeout_s": self.fetch_timeout_s,
            "mode": self.mode.value,
            "agent_address": address,
            "expect": msgspec.to_builtins(self.expect) if self.expect is not None else None,
            "keep": self.keep,
            "keep_gib": self.keep_gib,
            "keep_fp8": self.keep_fp8.value if self.keep_fp8 is not None else None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def setup(self) -> None:
        self.client  # noqa: B018 - made here, in the worker, before the first row

    @property
    def store(self) -> RowStore | None:
        """This process's store of kept rows (made on first use; None without ``keep``)."""
        if self._store is None and self.keep is not None:
            budget = int(self.keep_gib * 2**30) if self.keep_gib is not None else None
            self._store = RowStore(self.keep, budget, self.keep_fp8)
            # a DataLoader worker ends through multiprocessing's exit, which runs finalizers
            multiprocessing.util.Finalize(self, self._store.close, exitpriority=10)
        return self._store

    def close(self) -> None:
        """Close this process's client and, in the rank that started it, the fetch agent."""
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None
            self._address = None

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        """Row ``file_idx`` from the keep folder, verified, with the layers the trainer
        expects (by id, where the row holds more); None (it is generated, then kept)
        without one, or where it is not kept yet or was damaged."""
        store = self.store
        if store is None:
            return None
        layer_ids = self.expect.layer_ids if self.expect is not None else None
        # a row kept with more layers: the trainer's, by id
        got = store.get(file_idx, layer_ids)
        self.missed = file_idx if got is None and self.keeps else None
        return got

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """``token_ids`` int64 [T] and ``hidden_states`` [T, L, H] (the producer's dtype,
        contiguous) of the sample the server's ``kv_transfer_params`` name; raises
        ``FetchError`` saying why not (speculators retries the row), "mismatch" where it is
        not what the trainer expects (the client or the rank's agent checks its manifest
        before it READs)."""
        if self.mode is FetchMode.RANK and self._client is None:
            # the row's sample waits for the agent
            self._start_agent(keep=[hs_transfer_params])
        try:
            sample = self.client.fetch(hs_transfer_params)
        except FetchError as e:
            late = self.agent.slow_start() if self.agent is not None else None
            if late is None or e.code != "expired":
                raise
            raise FetchError(e.code, f"{e.message} ({late})") from None
        if len(self._released) >= MAX_REMEMBERED:
            # forgotten ones are only released once more (harmless)
            self._released.clear()
        self._released.add(handle_of(hs_transfer_params))
        # kept behind the hand-out, once
        if self.missed is not None and self.store is not None:
            meta = {"request_id": sample.request_id, "layer_ids": ",".join(map(str, sample.layer_ids))}
            if sample.provenance is not None:
                meta.update(sample.provenance.as_dict())
            self.store.put(self.missed, sample.token_ids, sample.hidden_states, meta)
            self.missed = None
        return {"token_ids": sample.token_ids, "hidden_states": sample.hidden_states}

    def delete(self, handle: str) -> None:
        # released when it was fetched: no round trip
        if handle in self._released:
            self._released.discard(handle)
            return
        self.client.release(handle)


def expectation_of(args: argparse.Namespace) -> Expectation | None:
    """What the trainer's arguments say every row must be: the verifier
    (``--verifier-name-or-path``) and, where its ``config.json`` is on this node, the
    captured layer ids: ``--target-layer-ids`` (speculators' default ``[2, n // 2,
    n - 3]``) and the last layer ``n``, which speculators' launcher appends."""
    model = str(getattr(args, "verifier_name_or_path", "") or "") or None
    layer_ids = None
    if model is not None:
        try:
            config = json.loads((Path(model) / "config.json").read_text())
            n = int(config.get("text_config", config)["num_hidden_layers"])
        except (OSError, ValueError, KeyError, TypeError):
            n = None
        if n is not None:
            aux = getattr(args, "target_layer_ids", None) or [2, n // 2, n - 3]
            layer_ids = [int(i) for i in aux] + [n]
    if model is None and layer_ids is None:
        return None
    return Expectation(layer_ids=layer_ids, model=model)


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
        modes = [m.value for m in FetchMode]
        _add(
            parser,
            "--kv-hs-fetch-agent",
            choices=modes,
            default=FetchMode.RANK.value,
            help="rank: one fetch agent (one NIXL agent, one pool) per trainer rank, shared by its "
            "DataLoader workers through shared memory; worker: a client in each worker",
        )
        _add(
            parser,
            "--kv-hs-pool-mib",
            type=int,
            default=None,
            help=f"the receive pool in MiB: the rank agent's (default {DEFAULT_RANK_POOL_MIB}) or, with "
            f"--kv-hs-fetch-agent worker, each worker's (default {DEFAULT_POOL_MIB}); a row must fit",
        )
        _add(
            parser,
            "--kv-hs-keep",
            default=None,
            metavar="DIR",
            help="keep each fetched row in DIR (speculators' file layout, verified on read): later epochs "
            "read it from there, not from vLLM; `--hidden-states-backend file --hidden-states-path DIR` "
            "trains other drafters from it (on /dev/shm: the RAM tier)",
        )
        _add(
            parser,
            "--kv-hs-keep-gib",
            type=float,
            default=None,
            help="at most this many GiB of files in the keep folder; then keeping stops (nothing kept "
            "is evicted) and later rows are fetched every epoch",
        )
        _add(
            parser,
            "--kv-hs-keep-fp8",
            choices=[s.value for s in Fp8Scale],
            default=None,
            help="keep rows in speculators' fp8 layout (scales per token or per layer), read back as bf16",
        )
        _add(
            parser,
            "--kv-hs-sampler",
            choices=[k.value for k in SamplerKind],
            default=SamplerKind.SPECULATORS.value,
            help="rank-kept: each trainer rank reads the same rows every epoch (fixed by --seed, "
            "shuffled within the rank each epoch, as many batches on every rank), so with --kv-hs-keep "
            "later epochs find every row in the node's folder; speculators: its own sampler",
        )
        _add(
            parser,
            "--kv-hs-fetch-timeout-s",
            type=float,
            default=DEFAULT_FETCH_TIMEOUT_S,
            help="how long one row's fetch may take",
        )

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        _add(
            parser,
            "--kv-hs-pull-listen",
            default=DEFAULT_PULL_LISTEN,
            help="where each vLLM rank serves its samples, HOST or HOST:PORT (a non-loopback "
            "address needs KV_CONNECTOR_SECRET on both ends)",
        )
        _add(
            parser,
            "--kv-hs-pull-timeout-s",
            type=float,
            default=DEFAULT_PULL_TIMEOUT_S,
            help="a sample not released by then is freed (a fetch then fails 'expired')",
        )

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> KvHiddenStatesTransfer:
        pool_mib = getattr(args, "kv_hs_pool_mib", None)
        use_sampler(getattr(args, "kv_hs_sampler", None) or SamplerKind.SPECULATORS.value)
        return KvHiddenStatesTransfer(
            pool_mib=None if pool_mib is None else int(pool_mib),
            fetch_timeout_s=float(getattr(args, "kv_hs_fetch_timeout_s", DEFAULT_FETCH_TIMEOUT_S)),
            mode=FetchMode(getattr(args, "kv_hs_fetch_agent", FetchMode.RANK.value)),
            expect=expectation_of(args),
            keep=getattr(args, "kv_hs_keep", None),
            keep_gib=getattr(args, "kv_hs_keep_gib", None),
            keep_fp8=getattr(args, "kv_hs_keep_fp8", None),
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


# run as a program, main() registers the importable module's classes
if __name__ != "__main__":
    register()

__all__ = [
    "BACKEND",
    "FetchError",
    "FetchMode",
    "KvHiddenStatesBackend",
    "KvHiddenStatesTransfer",
    "SamplerKind",
    "register",
    "use_sampler",
]


def main(argv: list[str] | None = None) -> None:
    """speculators' own CLI, with this backend registered."""
    # under its own name, whatever runs it
    import kv_connector.speculators as registered

    registered.register()
    from speculators.__main__ import app

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    app()


if __name__ == "__main__":
    main()
