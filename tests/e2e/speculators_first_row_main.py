"""A trainer rank's first row, fetched in the rank itself, for tests/e2e/test_agent_start.py,
in a process of its own whose PYTHONPATH holds speculators:

    speculators_first_row_main.py SERVER_SOCKET MODEL PROMPT_JSON OUT_FILE

builds our backend's transfer as speculators' trainer does (``from_train_args``, the
rank's fetch agent by default, its default pool), posts one completion to the vLLM server
listening on SERVER_SOCKET, and fetches the row with ``get_generated`` at once: the
rank's fetch agent starts on that first use. What it got goes to OUT_FILE (safetensors),
and a JSON line to stdout: the seconds from the response to the row in hand, the agent's
start as the rank saw it and phase by phase, what was kept at the producer meanwhile, and
the error if the fetch failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path


def main() -> int:
    socket_path, model, out_file = sys.argv[1], sys.argv[2], Path(sys.argv[4])
    prompt = json.loads(sys.argv[3])
    from hs_connectors.transfer import HiddenStatesBackend
    from safetensors.torch import save_file

    from kv_connector.datagen.httpclient import Server

    importlib.import_module("kv_connector.speculators")
    backend = HiddenStatesBackend.registry["kv-hidden-states"]
    parser = argparse.ArgumentParser()
    backend.add_train_args(parser)
    transfer = backend.from_train_args(parser.parse_args([]), "/nonexistent")
    http = Server(f"unix:{socket_path}")
    resp = http.post_json(
        "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    )
    t0 = time.monotonic()
    report: dict[str, object] = {}
    try:
        got = transfer.get_generated(resp["kv_transfer_params"])
        assert got is not None
        report["served_s"] = time.monotonic() - t0
        save_file({"token_ids": got["token_ids"], "hidden_states": got["hidden_states"]}, str(out_file))
    except Exception as e:  # reported: the test says what failed
        report["error"] = f"{type(e).__name__}: {e}"
        report["failed_after_s"] = time.monotonic() - t0
    agent = transfer.agent
    assert agent is not None
    report.update(
        request_id=resp["kv_transfer_params"]["hidden_states"]["request_id"],
        agent_start_s=agent.start_s,
        agent_phases=agent.start_phases,
        kept=agent.kept.kept,
        refused={k: str(v) for k, v in agent.kept.refused.items()},
    )
    transfer.close()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
