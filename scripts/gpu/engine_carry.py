"""What the engine tier carries to a GPU host with no package index, and its measure.

Three parts, built here into the ignored folder ``.gpu-carry/engine``: vLLM 0.33.0's own
Python code (from its wheel, unpacked by ``scripts/fetch_vllm033.sh``) less
everything that is not Python, packed as tar.xz; the
wheels of the packages vLLM needs that the host lacks (found with
``scripts.gpu.restricted_import``); NIXL (``nixl-cu13``) less its expert-parallel part,
its plugins other than UCX and its headers, packed as tar.xz. Not yet run on a GPU.

    python -m scripts.gpu.engine_carry [--vllm-tree DIR] [--nixl-wheel WHEEL] [--rebuild]
"""

from __future__ import annotations

import argparse
import email.parser
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / ".gpu-carry" / "engine"
VLLM_TREE = REPO / ".venv" / "vllm-0.33"
HOST_PACKAGES = Path(__file__).resolve().parent / "gpu_host_packages.txt"
LIMIT_BYTES = 64 << 20
# the packages vLLM 0.33 imports that the host lacks (the restricted import's finding)
WHEELS = [
    "msgspec==0.22.0",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "pyzmq==27.3.0",
    "cbor2==6.3.0",
    "oss-harmony==0.0.11",
    "pybase64==1.5.1",
    "openai==3.57.0",
    "jiter==0.19.0",
    "distro==1.9.0",
    "cachetools==8.0.2",
    "more-itertools==11.2.1",
    "xgrammar==0.2.8",
    "apache-tvm-ffi==0.1.11",
    "fastapi==0.136.3",
    "starlette==1.10.0",
    "partial-json-parser==0.2.1.1.post7",
    "compressed-tensors==0.17.0",
    "loguru==0.7.3",
    # openai's own dependencies the host lacks (its wheel's Requires-Dist against the host's list)
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "truststore==0.10.5",
    "sniffio==1.3.1",
    "nixl==1.5.1",  # the `nixl` import name (loads nixl_cu<torch's CUDA major>, packed below)
]
NIXL_CU13 = "nixl-cu13==1.5.1"
# stand-ins for what cannot travel, each imported unguarded on the engine's path
STAND_IN_KERNELS = (Path(__file__).resolve().parent / "stand_in_kernels.py").read_text()
STAND_IN_FLASH_ATTN = (Path(__file__).resolve().parent / "stand_in_flash_attn.py").read_text()
STAND_IN_MOE = (Path(__file__).resolve().parent / "stand_in_moe.py").read_text()
STAND_IN_LLGUIDANCE = (
    '"""Stand-in: vLLM names these types in an annotation; structured output is not run."""\n\n\n'
    "class LLMatcher:\n    pass\n\n\nclass LLTokenizer:\n    pass\n"
)
STAND_INS = {
    # platforms/cuda.py: `import vllm._C_stable_libtorch` (compiled for torch 2.14)
    "vllm/_C_stable_libtorch.py": STAND_IN_KERNELS,
    # platforms/cuda.py: `import vllm._moe_C_stable_libtorch` under suppress(ImportError): MoE ops
    "vllm/_moe_C_stable_libtorch.py": STAND_IN_MOE,
    "vllm/vllm_flash_attn/__init__.py": STAND_IN_FLASH_ATTN,
    # v1/structured_output/backend_guidance.py evaluates llguidance.LLMatcher in a dataclass
    "llguidance/__init__.py": STAND_IN_LLGUIDANCE,
}


def vllm_files(tree: Path) -> Iterator[tuple[Path, str]]:
    """(file, name in the archive) of the pruned vLLM tree: its Python files and the
    small data files beside them; never vllm-rs, headers or compiled files. Every model
    file and ``third_party``'s Python travel: the tiny models' modules import siblings
    (``models/config.py``, the EAGLE-3 proposers' models) and ``third_party`` holds the
    pynvml that CUDA platform detection imports and the gated delta net's Triton kernels."""
    for p in sorted(tree.rglob("*")):
        rel = p.relative_to(tree).as_posix()
        if not p.is_file() or rel.startswith("vllm/vllm-rs"):
            continue
        if p.suffix in (".so", ".h", ".cuh", ".hpp", ".cu", ".cpp", ".pyc"):
            continue
        if p.suffix != ".py" and p.stat().st_size > 1 << 20:
            continue
        yield p, rel


Preset = Literal[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def pack_vllm(tree: Path, out: Path, preset: Preset = 9) -> Path:
    """The pruned tree and the stand-ins as tar.xz (``preset``: xz's level; a lower one
    packs faster and larger)."""
    dest = out / "vllm-0.33.0-py.tar.xz"
    with tarfile.open(dest, "w:xz", preset=preset) as tar:
        for p, rel in vllm_files(tree):
            if rel not in STAND_INS:  # each replaced file travels once: as its stand-in
                tar.add(p, rel)
        for rel, text in STAND_INS.items():
            data = text.encode()
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return dest


def pack_nixl(wheel: Path, out: Path, preset: Preset = 9) -> Path:
    """NIXL less ``nixl_ep``, headers, scripts and every plugin but UCX."""
    dest = out / "nixl-cu13-1.5.1-ucx.tar.xz"
    with zipfile.ZipFile(wheel) as z, tarfile.open(dest, "w:xz", preset=preset) as tar:
        for i in z.infolist():
            n = i.filename
            base = n.rsplit("/", 1)[-1]
            if n.startswith(("nixl_ep", "nixl_cu13.scripts")) or "/headers/" in n:
                continue
            if "libplugin_" in base and "libplugin_UCX" not in base:
                continue
            data = z.read(i)
            info = tarfile.TarInfo(n)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return dest


def measure(out: Path) -> dict[str, object]:
    files = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    total = sum(files.values())
    return {"files": files, "total_MiB": round(total / (1 << 20), 2), "limit_MiB": LIMIT_BYTES >> 20}


def wheel_prefix(requirement: str) -> str:
    """How a wheel file of ``requirement`` is named at its start (pip writes '-' as '_')."""
    name, version = requirement.split("==")
    return f"{name.replace('-', '_')}-{version}-"


def wheels_complete(dest: Path) -> bool:
    return all(any(dest.glob(f"{wheel_prefix(r)}*.whl")) for r in WHEELS)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def unmet_requirements(wheels: Path, host: Path = HOST_PACKAGES) -> dict[str, list[str]]:
    """Each carried wheel's requirements (its ``Requires-Dist``, extras and markers that
    exclude Linux on CPython 3.12 left out) that neither the host's package list nor the
    carry meets: {wheel's distribution: [requirement, ...]}; empty when the carry is whole."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    env.update(python_version="3.12", python_full_version="3.12.0", sys_platform="linux")
    env.update(platform_system="Linux", implementation_name="cpython", extra="")
    have = {normalize(ln.split("==", 1)[0]) for ln in host.read_text().splitlines() if "==" in ln}
    metadata = {}
    for w in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(w) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            md = email.parser.Parser().parsestr(z.read(name).decode())
        metadata[normalize(md["Name"])] = md
    have |= set(metadata)
    unmet: dict[str, list[str]] = {}
    for dist, md in metadata.items():
        for text in md.get_all("Requires-Dist") or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if normalize(req.name) not in have and not (dist == "nixl" and req.name.startswith("nixl-cu")):
                unmet.setdefault(dist, []).append(text)
    return unmet


def fetch_wheels(requirements: list[str], dest: Path) -> None:
    """cp312 manylinux wheels of ``requirements`` into ``dest``, without dependencies (on a
    machine with the package index)."""
    from scripts.gpu.carry import PLATFORM_FLAGS

    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps"]
    proc = subprocess.run(
        [*cmd, *PLATFORM_FLAGS, "-d", str(dest), *requirements], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"cannot fetch the engine carry's wheels: {proc.stderr.strip()[-2000:]}")


def build(
    out: Path = OUT, vllm_tree: Path = VLLM_TREE, nixl_wheel: Path | None = None, preset: Preset = 9
) -> dict[str, object]:
    """The carry in ``out``, each part made only where it is missing; its measure. vLLM's
    tree comes from ``scripts/fetch_vllm033.sh`` and the wheels from the index when absent."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "vllm-0.33.0-py.tar.xz").is_file():
        if not (vllm_tree / "vllm" / "__init__.py").is_file():
            subprocess.run(["bash", str(REPO / "scripts" / "fetch_vllm033.sh"), str(vllm_tree)], check=True)
        pack_vllm(vllm_tree, out, preset)
    if not (out / "nixl-cu13-1.5.1-ucx.tar.xz").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            if nixl_wheel is None:
                fetch_wheels([NIXL_CU13], Path(tmp))
                nixl_wheel = next(Path(tmp).glob(f"{wheel_prefix(NIXL_CU13)}*.whl"))
            pack_nixl(nixl_wheel, out, preset)
    if not wheels_complete(out / "wheels"):
        fetch_wheels(
            [r for r in WHEELS if not any((out / "wheels").glob(f"{wheel_prefix(r)}*.whl"))], out / "wheels"
        )
    return measure(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-tree", type=Path, default=VLLM_TREE)
    ap.add_argument("--nixl-wheel", type=Path, help="nixl-cu13's cp312 wheel (default: fetched)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--rebuild", action="store_true", help="pack vLLM and NIXL again")
    args = ap.parse_args()
    if args.rebuild:
        for name in ("vllm-0.33.0-py.tar.xz", "nixl-cu13-1.5.1-ucx.tar.xz"):
            (args.out / name).unlink(missing_ok=True)
    print(json.dumps(build(args.out, args.vllm_tree, args.nixl_wheel)))


if __name__ == "__main__":
    main()
