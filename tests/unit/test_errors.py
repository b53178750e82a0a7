"""One error family: every exception class of ``kv_connector`` and ``hybrid`` is a
``KvConnectorError`` under exactly one branch, and keeps the builtin base its callers catch.

The classes are found by importing every module of both packages and asking ``inspect``, so a
class added later is held to the same rule. A module that cannot be imported here for want of
an optional package (the trainer's ``hs_connectors``, say) is read as source instead: none of
its classes may derive from a builtin exception without a family base."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

import hybrid
import kv_connector
import kv_connector.reader
from kv_connector.common.errors import (
    BRANCHES,
    ClosedError,
    ConfigurationError,
    IntegrityError,
    KvConnectorError,
    RefusedError,
    StateError,
    WireError,
)

# what a module may lack here and still be skipped (read as source): the top-level packages
# that are not this project's own dependencies on every machine
OPTIONAL = {"vllm", "nixl", "nixl_cu12", "nixl_cu13", "hs_connectors", "speculators", "datasets"}

# every error class the project had before the family, with the builtin it was raised as:
# callers and tests catch them by it, so each keeps it
BUILTIN_BEFORE: dict[str, type[BaseException]] = {
    "kv_connector.sender.jobs.FrozenJob": Exception,
    "kv_connector.sender.job_states.IllegalJobTransition": RuntimeError,
    "kv_connector.sender.loop.SenderError": RuntimeError,
    "kv_connector.reader.pull.hold_fences.HoldFenceStale": Exception,
    "kv_connector.reader.pull.links.FetchError": RuntimeError,
    "kv_connector.reader.agent.client.FetchAgentError": RuntimeError,
    "kv_connector.reader.push.reader.ReaderClosed": Exception,
    "kv_connector.reader.push.reader.LeaseLimitError": RuntimeError,
    "kv_connector.reader.push.sample_states.IllegalSampleTransition": RuntimeError,
    "kv_connector.reader.push.metrics_server.MetricsAddressError": OSError,
    "kv_connector.reader.pool.pages.PoolTooSmall": ValueError,
    "kv_connector.reader.pool.values.BadValues": ValueError,
    "kv_connector.reader.pool.memory.PoolDeviceError": ValueError,
    "kv_connector.reader.pool.lease.SampleReleased": RuntimeError,
    "kv_connector.files.cli.DiskError": Exception,
    "kv_connector.files.keep.KeepFolderMismatch": ValueError,
    "kv_connector.files.journal.JournalLocked": RuntimeError,
    "kv_connector.producer.pull.ledger.PullRefused": Exception,
    "kv_connector.producer.pull.hold_states.IllegalTransition": RuntimeError,
    "kv_connector.producer.planning.SlotMismatch": ValueError,
    "kv_connector.wire.protocol.ProtocolError": ValueError,
    "kv_connector.wire.handle.HandleError": ValueError,
    "kv_connector.wire.transport.TransportError": RuntimeError,
    "kv_connector.wire.handshake.HandshakeError": Exception,
    "kv_connector.wire.outcome.OutcomeError": ValueError,
    "kv_connector.wire.layout.AmbiguousCacheView": ValueError,
    "kv_connector.wire.identity.IdentityError": ValueError,
    "kv_connector.wire.control.ConnectionClosed": Exception,
    "kv_connector.wire.control.OutputFull": Exception,
    "kv_connector.datagen.driver.RequestFailed": Exception,
    "kv_connector.datagen.row_states.IllegalRowTransition": RuntimeError,
    "kv_connector.datagen.httpclient.HTTPError": RuntimeError,
    "kv_connector.audit.AuditError": ValueError,
    "kv_connector.audit.AuditFailed": RuntimeError,
    "hybrid.plugin.UnsupportedVLLMError": RuntimeError,
    "hybrid.spec.NoAttentionGroupError": ValueError,
}

BRANCH_BUILTIN: dict[type[KvConnectorError], type[Exception]] = {
    ConfigurationError: ValueError,
    IntegrityError: ValueError,
    WireError: RuntimeError,
    RefusedError: RuntimeError,
    ClosedError: RuntimeError,
    StateError: RuntimeError,
}


def _walk() -> tuple[dict[str, ModuleType], dict[str, str]]:
    """Every module of both packages (``__main__`` modules, which run a CLI, aside): those
    imported, and those skipped with the optional package each lacks."""
    imported: dict[str, ModuleType] = {}
    skipped: dict[str, str] = {}
    for package in (kv_connector, hybrid):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.rsplit(".", 1)[-1] == "__main__":
                continue
            try:
                imported[info.name] = importlib.import_module(info.name)
            except ModuleNotFoundError as e:
                top = (e.name or "").split(".")[0]
                if top not in OPTIONAL:
                    raise
                skipped[info.name] = top
    return imported, skipped


IMPORTED, SKIPPED = _walk()


def exception_classes() -> dict[str, type[BaseException]]:
    """Each exception class defined at the top level of an imported module, by qualified name."""
    found = {}
    for name, module in IMPORTED.items():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == name and issubclass(obj, BaseException):
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


FOUND = exception_classes()


def test_the_walk_finds_every_error_class_there_was() -> None:
    assert set(BUILTIN_BEFORE) <= set(FOUND), sorted(set(BUILTIN_BEFORE) - set(FOUND))


def test_only_modules_needing_an_optional_package_are_skipped() -> None:
    # on a machine with vLLM (this project's CPU build) only the trainer's backend is skipped
    assert set(SKIPPED.values()) <= OPTIONAL
    assert "kv_connector.common.errors" in IMPORTED and "kv_connector.reader" in IMPORTED


@pytest.mark.parametrize("name", sorted(FOUND))
def test_every_error_class_is_in_the_family_under_one_branch(name: str) -> None:
    cls = FOUND[name]
    assert issubclass(cls, KvConnectorError), f"{name} is not a KvConnectorError: {cls.__mro__}"
    if cls is KvConnectorError or cls in BRANCHES:
        return
    under = [b.__name__ for b in BRANCHES if issubclass(cls, b)]
    assert len(under) == 1, f"{name} is under {under}, not under exactly one branch"


@pytest.mark.parametrize("name", sorted(BUILTIN_BEFORE))
def test_each_error_keeps_the_builtin_it_was_raised_as(name: str) -> None:
    assert issubclass(FOUND[name], BUILTIN_BEFORE[name])


@pytest.mark.parametrize("branch", BRANCHES, ids=[b.__name__ for b in BRANCHES])
def test_each_branch_is_a_builtin_error_too(branch: type[KvConnectorError]) -> None:
    assert issubclass(branch, BRANCH_BUILTIN[branch])
    assert branch.__bases__ == (KvConnectorError, BRANCH_BUILTIN[branch])


def test_a_skipped_module_defines_no_error_outside_the_family() -> None:
    """Read as source: a class deriving from a builtin exception names a family class too."""
    family = {cls.__name__ for cls in FOUND.values()}
    builtin_errors = {
        n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    roots = {Path(p).parent for p in (kv_connector.__file__, hybrid.__file__) if p is not None}
    strays = []
    for name in SKIPPED:
        top, _, rest = name.partition(".")
        root = next(r for r in roots if r.name == top)
        path = root.joinpath(*rest.split(".")).with_suffix(".py")
        if not path.exists():
            path = root.joinpath(*rest.split("."), "__init__.py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & builtin_errors and not bases & family:
                    strays.append(f"{name}.{node.name}")
    assert not strays, strays


def test_an_os_error_in_the_family_keeps_its_errno() -> None:
    from kv_connector.reader.push.metrics_server import MetricsAddressError

    e = MetricsAddressError(98, "cannot serve metrics on 127.0.0.1:9: Address already in use")
    assert isinstance(e, ConfigurationError) and isinstance(e, OSError)
    assert (e.errno, e.strerror) == (98, "cannot serve metrics on 127.0.0.1:9: Address already in use")


def test_a_family_error_in_a_records_validation_still_reads_as_msgspecs() -> None:
    """A wire record refuses a bad field with a ``ConfigurationError``; decoding turns it into
    msgspec's ``ValidationError``, as it did the plain ``ValueError``."""
    from kv_connector.wire import protocol
    from kv_connector.wire.layout import BlockLayout

    g = BlockLayout("TLH", 16, 3, 64, "bfloat16")
    with pytest.raises(ConfigurationError, match="2 layer ids for blocks of 3 layers"):
        protocol.Manifest(request_id="r", token_ids=[1, 2], layer_ids=[2, 5], geometry=g, num_blocks=1)
    good = protocol.Manifest(request_id="r", token_ids=[1, 2], layer_ids=[2, 5, 7], geometry=g, num_blocks=1)
    bad = {**msgspec.to_builtins(good), "layer_ids": [2, 5]}
    with pytest.raises(msgspec.ValidationError, match="2 layer ids for blocks of 3 layers"):
        msgspec.convert(bad, protocol.Manifest)


def test_the_readers_face_exports_the_root_and_every_branch() -> None:
    family: tuple[type[KvConnectorError], ...] = (KvConnectorError, *BRANCHES)
    for cls in family:
        assert getattr(kv_connector.reader, cls.__name__) is cls
        assert cls.__name__ in kv_connector.reader.__all__
