"""A Python that imports only what a GPU host with no package index has: an import hook
that admits the standard library, the packages of ``gpu_host_packages.txt`` (that host's
``pip freeze``), this repository's packages and whatever folders are named as carried,
and makes every other top-level import fail as a missing module would there.

Run as a module, it imports the engine tier's vLLM modules under the hook and prints one
JSON line: each refused top-level name with the modules that asked for it, each module
that failed to import and why, and the vLLM files that were imported (what the carry
must hold)::

    VLLM_TARGET_DEVICE=cpu python -m scripts.gpu.restricted_import --carried DIR [--carried DIR ...]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import re
import sys
import traceback
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HOST_PACKAGES = HERE / "gpu_host_packages.txt"
OURS = ("kv_connector", "hybrid", "scripts", "tests")
# distributions whose import name is not their normalized distribution name, for those
# the GPU host has that this machine may not have installed
KNOWN_IMPORT_NAMES = {
    "pyyaml": ["yaml"],
    "pyzmq": ["zmq"],
    "pillow": ["PIL"],
    "protobuf": ["google"],
    "opencv-python-headless": ["cv2"],
    "py-cpuinfo": ["cpuinfo"],
    "python-dateutil": ["dateutil"],
    "scikit-learn": ["sklearn"],
    "scikit-image": ["skimage"],
    "beautifulsoup4": ["bs4"],
    "attrs": ["attr", "attrs"],
    "jinja2": ["jinja2"],
    "markupsafe": ["markupsafe"],
    "typing-extensions": ["typing_extensions"],
    "huggingface-hub": ["huggingface_hub"],
    "cuda-bindings": ["cuda"],
    "cuda-core": ["cuda"],
    "cuda-pathfinder": ["cuda"],
    "nvidia-ml-py": ["pynvml"],
    "prometheus-client": ["prometheus_client"],
}
# the GPU host's wheels that install modules under other top-level names (nvidia-* share one)
NAMESPACE_PREFIXES = {"nvidia-": "nvidia"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def host_distributions(path: Path = HOST_PACKAGES) -> dict[str, str]:
    """{normalized distribution name: version} of a ``pip freeze`` listing."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "==" not in line:
            continue
        name, version = line.split("==", 1)
        out[normalize(name)] = version
    return out


def import_names(distributions: Iterable[str]) -> set[str]:
    """The top-level import names of these distributions: from this machine's installed
    metadata where it has them, else the known exceptions, else the normalized name."""
    installed: dict[str, set[str]] = {}
    for top, dists in importlib.metadata.packages_distributions().items():
        for d in dists:
            installed.setdefault(normalize(d), set()).add(top)
    names: set[str] = set()
    for d in distributions:
        names |= installed.get(d, set())
        names |= set(KNOWN_IMPORT_NAMES.get(d, []))
        names.add(d.replace("-", "_"))
        for prefix, top in NAMESPACE_PREFIXES.items():
            if d.startswith(prefix):
                names.add(top)
    return names


def carried_names(folders: Sequence[Path]) -> set[str]:
    """Top-level names importable from carried folders (packages and modules)."""
    names: set[str] = set()
    for folder in folders:
        for p in folder.iterdir():
            if p.is_dir() and not p.name.endswith((".dist-info", ".data")):
                names.add(p.name)
            elif p.suffix in (".py", ".so"):
                names.add(p.name.split(".", 1)[0])
    return names


class HostOnly(importlib.abc.MetaPathFinder):
    """The path finder of a GPU host: finds a top-level module on ``sys.path`` only if
    that host (or the carry) has it, and records what it refuses and which module asked.
    A refused module is absent, as it is there: ``find_spec`` probes get None, imports
    ModuleNotFoundError."""

    def __init__(self, admitted: set[str], host: set[str]) -> None:
        self.admitted = admitted
        self.host = host  # the host's own packages: what they import is theirs to have
        self.refused: dict[str, set[str]] = {}
        self.theirs: dict[str, set[str]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.split(".", 1)[0]
        if top in sys.stdlib_module_names or top in self.admitted or top in sys.builtin_module_names:
            return importlib.machinery.PathFinder.find_spec(fullname, path, target)
        asker = _importer()
        first = asker.split(".", 1)[0]
        if first in sys.stdlib_module_names:  # the standard library's own (sysconfig's data)
            return importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if first in self.host or first in self.theirs:
            # a host package's own import: its version there comes with what it needs (the
            # freeze is complete); this machine's version of it may want other things
            self.theirs.setdefault(top, set()).add(asker)
            return importlib.machinery.PathFinder.find_spec(fullname, path, target)
        self.refused.setdefault(top, set()).add(asker)
        return None

    def invalidate_caches(self) -> None:
        importlib.machinery.PathFinder.invalidate_caches()

    def find_distributions(self, *args: Any, **kwargs: Any) -> Iterator[importlib.metadata.Distribution]:
        """Installed metadata, as ``importlib.metadata`` asks the path finder for it."""
        return iter(importlib.machinery.PathFinder.find_distributions(*args, **kwargs))


def _importer() -> str:
    """The module whose code asked for the import (the first frame outside importlib)."""
    for frame, _ in traceback.walk_stack(None):
        name = frame.f_globals.get("__name__", "")
        ours = name.startswith(("importlib", "scripts.gpu.restricted_import")) or name == "__main__"
        if name and not ours:
            return str(name)
    return "?"


def install(carried: Sequence[Path], wheels: Iterable[str] = (), host: Path = HOST_PACKAGES) -> HostOnly:
    """The hook, first on ``sys.meta_path``; ``wheels``: distributions the carry brings as
    wheels (this machine's installed copies stand in for them: a cp312 wheel's compiled
    part does not load in another Python)."""
    on_host = import_names(host_distributions(host))
    admitted = on_host | carried_names(carried) | set(OURS) | import_names(normalize(w) for w in wheels)
    hook = HostOnly(admitted, on_host - {"vllm"})
    sys.meta_path[:] = [hook if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    return hook


# what the engine tier imports: vLLM's engine and offline API, Model Runner V2, the
# Triton attention backend, the two tiny models, extract_hidden_states, our connector
ENGINE_MODULES = [
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.worker.gpu.spec_decode.extract_hidden_states",
    "vllm.v1.spec_decode.extract_hidden_states",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.gdn_attn",
    "vllm.v1.attention.backends.mamba_attn",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen3_next",
    "vllm.model_executor.models.extract_hidden_states",
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
    "vllm.model_executor.layers.mamba.ops.causal_conv1d",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.compilation.cuda_graph",
    "kv_connector.connector",
    "hybrid.plugin",
]


def check(modules: Sequence[str], carried: Sequence[Path], wheels: Iterable[str] = ()) -> dict[str, object]:
    hook = install(carried, wheels)
    failed: dict[str, str] = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # report every module, not the first failure only
            where = traceback.extract_tb(e.__traceback__)[-1]
            failed[name] = f"{type(e).__name__}: {e} ({Path(where.filename).name}:{where.lineno})"
    vllm_files = sorted(
        str(Path(f).resolve())
        for n, m in list(sys.modules.items())
        if (n == "vllm" or n.startswith("vllm.")) and (f := getattr(m, "__file__", None))
    )
    return {
        "refused": {k: sorted(v) for k, v in sorted(hook.refused.items())},
        "host_packages_own": sorted(hook.theirs),
        "failed": failed,
        "vllm_modules": vllm_files,
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--carried", action="append", type=Path, default=[], help="a carried folder, on sys.path")
    ap.add_argument("--wheel", action="append", default=[], help="a distribution the carry brings as a wheel")
    ap.add_argument("--module", action="append", default=[], help="import these instead of the engine tier's")
    ap.add_argument("--out", type=Path, help="write the JSON line here (default: standard output)")
    args = ap.parse_args(argv)
    for folder in reversed(args.carried):
        sys.path.insert(0, str(folder))
    line = json.dumps(check(args.module or ENGINE_MODULES, args.carried, args.wheel))
    if args.out is not None:
        args.out.write_text(line + "\n")
    else:
        print(line, flush=True)


if __name__ == "__main__":
    main()
