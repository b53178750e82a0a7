"""``python -m kv_connector.reader``: the name users know for the file-writing CLI, which
lives in ``kv_connector.files`` (run by name, so the library never imports its CLI)."""

import runpy

runpy.run_module("kv_connector.files", run_name="__main__", alter_sys=True)
