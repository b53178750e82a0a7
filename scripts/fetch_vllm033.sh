#!/usr/bin/env bash
# vLLM 0.33.0's Python code, for `make test-vllm033`: its wheel (a CUDA build, 336 MB) is
# downloaded once and unpacked without its compiled files (*.so, ~180 MB of Python left)
# into DIR (default .venv/vllm-0.33: git-ignored, never scanned by ruff, mypy or pytest).
# Put ahead of .venv on PYTHONPATH with VLLM_TARGET_DEVICE=cpu, it runs on CPU for
# everything short of executing a model (vLLM 0.33 has no CPU kernels).
# Idempotent: an unpacked tree (marked complete) is kept, nothing is downloaded. A failed
# download is an error (exit status != 0), never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${VLLM033_VERSION:-0.33.0}"
DIR="${1:-.venv/vllm-0.33}"
PY="${PYTHON:-.venv/bin/python}"
if [ -f "$DIR/.complete-$VERSION" ]; then
  exit 0
fi
WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS" "$DIR.partial"' EXIT
echo "fetching vLLM $VERSION's Python code into $DIR (download once, ~336 MB)"
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary :all: \
  "vllm==$VERSION" -d "$WHEELS"
rm -rf "$DIR.partial"
mkdir -p "$DIR.partial"
"$PY" - "$WHEELS" "$DIR.partial" "$VERSION" <<'PY'
import sys, zipfile
from pathlib import Path

wheels, out, version = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
(wheel,) = wheels.glob(f"vllm-{version}-*.whl")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if not n.endswith(".so")]
    z.extractall(out, names)
init = Path(out, "vllm", "__init__.py")
assert init.is_file(), f"{wheel.name}: no vllm/__init__.py"
print(f"unpacked {len(names)} files of {wheel.name} (compiled files left out)")
PY
touch "$DIR.partial/.complete-$VERSION"
rm -rf "$DIR"
mv "$DIR.partial" "$DIR"
