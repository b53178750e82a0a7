"""What travels to a GPU host for the device tier, and how it is set up there.

The host has Python 3.12, torch with CUDA 13, numpy and xxhash, no vLLM, NIXL or
msgspec, and no package index: the working tree travels (tracked files and untracked ones
git does not ignore) with up to 8 ignored paths, 64 MiB in all. The wheels
below are fetched here into ``CARRY_DIR`` (ignored by git), carried, and installed there
into a folder of their own with pip's ``--target`` (no index, no dependencies).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRY_DIR = REPO / ".gpu-carry"
LIMIT_BYTES = 64 << 20  # what may travel with the repository, in all
PYTHON = "3.12"  # the GPU host's


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    why: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def prefix(self) -> str:
        """How its wheel file's name starts (pip writes '-' in names as '_')."""
        return f"{self.name.replace('-', '_')}-{self.version}-"


WHEELS = [
    Wheel("nixl-cu13", "1.5.1", "NIXL and the UCX it bundles, for torch on CUDA 13 (56 MiB)"),
    Wheel("nixl", "1.5.1", "the `nixl` import name, which loads nixl_cu<torch's CUDA major>"),
    Wheel("msgspec", "0.22.0", "the control messages (the version this project's venv runs)"),
]
# what a cp312 manylinux machine installs: pip download's flags for it
PLATFORM_FLAGS = [
    "--only-binary=:all:",
    "--python-version",
    PYTHON,
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
]


def fetch_command(dest: Path = CARRY_DIR) -> list[str]:
    """The pip command that fetches the wheels into ``dest`` (on a machine with the index)."""
    reqs = [w.requirement for w in WHEELS]
    return [sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM_FLAGS, "-d", str(dest), *reqs]


def wheel_files(dest: Path = CARRY_DIR) -> dict[str, Path]:
    """Each wheel's file in ``dest`` (KeyError-free: missing ones are left out)."""
    out: dict[str, Path] = {}
    for w in WHEELS:
        found = sorted(p for p in dest.glob(f"{w.prefix}*.whl") if p.is_file())
        if found:
            out[w.name] = found[-1]
    return out


def fetch(dest: Path = CARRY_DIR) -> dict[str, Path]:
    """The wheels, fetched into ``dest`` when they are not there yet."""
    have = wheel_files(dest)
    if len(have) < len(WHEELS):
        dest.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(fetch_command(dest), capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"cannot fetch the device tier's wheels: {proc.stderr.strip()[-2000:]}")
        have = wheel_files(dest)
    missing = [w.requirement for w in WHEELS if w.name not in have]
    if missing:
        raise SystemExit(f"wheels missing in {dest} after fetching: {', '.join(missing)}")
    return have


def travelling_files(repo: Path = REPO) -> list[Path]:
    """The working tree as it travels to the GPU host: tracked files and untracked ones
    git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    return [repo / p for p in out.decode().split("\0") if p and (repo / p).is_file()]


def measure(dest: Path = CARRY_DIR, repo: Path = REPO) -> dict[str, object]:
    """The carry set's bytes: the repository as it travels, each wheel, the total
    against the 64 MiB that may travel."""
    wheels = {name: p.stat().st_size for name, p in fetch(dest).items()}
    tree = sum(p.stat().st_size for p in travelling_files(repo))
    total = tree + sum(wheels.values())
    return {
        "repository_bytes": tree,
        "wheels": {wheel_files(dest)[n].name: b for n, b in wheels.items()},
        "carry_dir": str(dest.relative_to(repo)) if dest.is_relative_to(repo) else str(dest),
        "total_bytes": total,
        "total_MiB": round(total / (1 << 20), 2),
        "limit_MiB": LIMIT_BYTES >> 20,
        "fits": total <= LIMIT_BYTES,
    }


def install(dest: Path = CARRY_DIR) -> Path:
    """The carried wheels installed into a folder of their own (once per Python and set of wheels),
    which the caller puts first on ``sys.path`` / ``PYTHONPATH``. pip without an index
    or dependencies; where this Python has no pip, the wheels are unpacked (their
    ``.data`` parts, headers and the like, are not needed)."""
    files = wheel_files(dest)
    missing = [w.requirement for w in WHEELS if w.name not in files]
    if missing:
        raise SystemExit(
            f"the device tier's wheels are not in {dest}: {', '.join(missing)}; fetch them on a "
            "machine with the package index: python -m scripts.gpu_check --tier device --plan"
        )
    tag = hashlib.sha256("".join(sorted(p.name for p in files.values())).encode()).hexdigest()[:12]
    # outside the working tree: it never travels back or is counted in a carry
    site = (
        Path(tempfile.gettempdir())
        / f"gpu-check-site-cp{sys.version_info.major}{sys.version_info.minor}-{tag}"
    )
    stamp = site / ".installed"
    if stamp.exists():
        return site
    site.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    pip += ["--no-cache-dir", "--target", str(site)]
    proc = subprocess.run([*pip, *map(str, files.values())], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"gpu_check: pip could not install the wheels ({proc.stderr.strip()[-300:]}); unpacking them")
        for f in files.values():
            with zipfile.ZipFile(f) as z:
                z.extractall(site, [n for n in z.namelist() if not n.split("/", 1)[0].endswith(".data")])
    stamp.write_text("\n".join(p.name for p in files.values()) + "\n")
    return site
