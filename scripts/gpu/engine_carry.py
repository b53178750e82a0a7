"""What the engine tier carries to a GPU host with no package index, and its measure.

Three parts, built here into the ignored folder ``.gpu-carry/engine``: vLLM 0.33.0's own
Python code (from its wheel, unpacked by ``scripts/fetch_vllm033.sh``) less
everything that is not Python, packed as tar.xz; the
wheels of the packages vLLM needs that the host lacks (found with
``scripts.gpu.restricted_import``); NIXL (``nixl-cu13``) less its expert-parallel part,
its plugins other than UCX and its headers, packed as tar.xz. Not yet run on a GPU.

    python -m scripts.gpu.engine_carry [--vllm-tree DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / ".gpu-carry" / "engine"
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
]
# stand-ins for what cannot travel, each imported unguarded on the engine's path
STAND_IN_KERNELS = (
    '"""Stand-in for vLLM\'s compiled kernels (built for another torch): registers no op;\n'
    'the engine tier runs TRITON_ATTN and custom_ops [\'none\'] so none is asked for."""\n'
)
STAND_IN_LLGUIDANCE = (
    '"""Stand-in: vLLM names these types in an annotation; structured output is not run."""\n\n\n'
    "class LLMatcher:\n    pass\n\n\nclass LLTokenizer:\n    pass\n"
)
STAND_INS = {
    # platforms/cuda.py: `import vllm._C_stable_libtorch` (compiled for torch 2.14)
    "vllm/_C_stable_libtorch.py": STAND_IN_KERNELS,
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


def pack_vllm(tree: Path, out: Path) -> Path:
    dest = out / "vllm-0.33.0-py.tar.xz"
    with tarfile.open(dest, "w:xz", preset=9) as tar:
        for p, rel in vllm_files(tree):
            tar.add(p, rel)
        for rel, text in STAND_INS.items():
            data = text.encode()
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return dest


def pack_nixl(wheel: Path, out: Path) -> Path:
    """NIXL less ``nixl_ep``, headers, scripts and every plugin but UCX."""
    dest = out / "nixl-cu13-1.5.1-ucx.tar.xz"
    with zipfile.ZipFile(wheel) as z, tarfile.open(dest, "w:xz", preset=9) as tar:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-tree", type=Path, default=REPO / ".venv" / "vllm-0.33")
    ap.add_argument("--nixl-wheel", type=Path, required=True)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    pack_vllm(args.vllm_tree, OUT)
    pack_nixl(args.nixl_wheel, OUT)
    print(json.dumps(measure(OUT)))


if __name__ == "__main__":
    main()
