"""What the e2e test modules share besides conftest's fixtures: the speculators install,
the tiny Llama's capture settings, the scripts the trainer-side tests run, and what they
read of a running OpenAI server (its metrics, its log from a point on)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.e2e.api_server import ApiServer
from tests.e2e.conftest import REPO

# The tiny Llama has 4 layers: ids 1 and 2 are the drafter's auxiliary layers, 4 (the
# layer count) the final layer's output before the norm, which speculators takes as the
# verifier's last hidden state (the last of the captured layers).
LAYER_IDS = [1, 2, 4]
BLOCK = 128  # pinned in every engine the tests build (vLLM's CPU default); read from the tensor
HIDDEN = 128
SPEC_MAIN = REPO / "tests" / "e2e" / "speculators_main.py"
PULL_MAIN = REPO / "tests" / "e2e" / "speculators_pull_main.py"
UDS_SITE = REPO / "scripts" / "support" / "uds_site"
PULL_TIMEOUT_S = 30.0  # the shared pull server's hold of a sample nobody fetches


def speculators_site() -> Path:
    """Where speculators and its imports are installed; skips the test where they are not."""
    env = os.environ.get("SPECULATORS_SITE")
    site = Path(env) if env else Path(sys.prefix) / "speculators-site-packages"
    if not (site / "speculators").is_dir() or not (site / "hs_connectors").is_dir():
        pytest.skip(f"speculators is not installed in {site} (scripts/setup_env.sh installs it)")
    return site


def log_since(server: ApiServer, offset: int) -> str:
    """What the server logged from byte ``offset`` of its log on (a shared server's log
    holds earlier tests' lines before it)."""
    with server.log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def requests_done(server: ApiServer) -> float:
    """vLLM's count of the requests it finished since it started."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in server.http.get_text("/metrics").splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def kv_cache_usage(server: ApiServer) -> float:
    for line in server.http.get_text("/metrics").splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:kv_cache_usage_perc in /metrics")
