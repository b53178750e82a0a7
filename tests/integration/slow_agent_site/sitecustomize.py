"""In a process whose PYTHONPATH holds this folder, a rank's fetch agent
(``python -m kv_connector.reader.agent.fetch_agent``) starts ``KV_TEST_AGENT_START_DELAY_S``
seconds late, as an agent whose interpreter waits for a core does; every other process
starts as usual. Python runs a ``sitecustomize`` at start in every process."""

import os
import sys
import time

_DELAY = float(os.environ.get("KV_TEST_AGENT_START_DELAY_S", "0") or 0)

if _DELAY > 0 and "kv_connector.reader.agent.fetch_agent" in getattr(sys, "orig_argv", []):
    time.sleep(_DELAY)
