"""``make bench``: every arm in turn, each arm's result as a line as it ends, then the
summary (``scripts.bench.summary``: the figures, their ceilings and the targets missed)
as one JSON object, the last line printed. The first and the last lines name the machine
and its load.

    python -m scripts.bench             # about 40 minutes on 2 cores; needs an idle machine
    python -m scripts.bench --only keep # one arm alone (its figures, the same last line)
    python -m scripts.bench --only protocol
"""

from __future__ import annotations

import argparse
import json
import os
import time

from scripts.bench.paired import machine_state
from scripts.bench.summary import flatten, summarise


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench", description=__doc__)
    ap.add_argument("--only", choices=["keep", "protocol"], help="run this arm alone")
    only = ap.parse_args().only
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from scripts.bench import audit, datapath, fp8, integrity, keep, model, protocol, step
    from scripts.bench.pull import run as pull

    start = machine_state()
    print("machine at start:", json.dumps(start), flush=True)
    t0 = time.time()
    if only == "keep":
        keep_out = keep.main()
        print("keep:", json.dumps(keep_out), flush=True)
        end = machine_state()
        last = {**keep.figures(keep_out), "machine": {**start, "load_avg_end": end["load_avg"]}}
        last["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(last), flush=True)
        return
    if only == "protocol":
        protocol_out = protocol.main()
        print("protocol:", json.dumps(protocol_out), flush=True)
        print(json.dumps({k: v for k, v in protocol_out.items() if not k.startswith(("push_", "pull_4"))}))
        return
    model_out = model.main()
    print("model-level:", json.dumps(flatten(model_out)), flush=True)
    datapath_out = datapath.main()
    print("data path:", json.dumps(flatten(datapath_out)), flush=True)
    steps = step.main()
    print("per step:", json.dumps(steps), flush=True)
    pull_out = pull.main()
    print("pull:", json.dumps(pull_out), flush=True)
    protocol_out = protocol.main()
    print("protocol:", json.dumps(protocol_out), flush=True)
    fp8_out = fp8.main()
    print("fp8 files:", json.dumps(fp8_out), flush=True)
    integrity_out = integrity.main()
    print("integrity records:", json.dumps(integrity_out), flush=True)
    audit_out = audit.main()
    print("logprob audit:", json.dumps(audit_out), flush=True)
    keep_out = keep.main()
    print("keep:", json.dumps(keep_out), flush=True)
    summary = summarise(model_out, datapath_out, steps, pull_out, fp8_out, protocol_out)
    summary["integrity_cpu_s_per_GB"] = {
        layout: {"producer": m["producer_cpu_s_per_GB"], "reader": m["reader_cpu_s_per_GB"]}
        for layout, m in integrity_out.items()
    }
    summary["audit_ms_per_sample"] = audit_out["audit_ms_per_sample"]
    summary["audit_share_of_consumer_cpu"] = audit_out["audit_share_of_consumer_cpu"]
    summary.update(keep.figures(keep_out))
    end = machine_state()
    summary["machine"] = {**start, "load_avg_start": start["load_avg"], "load_avg_end": end["load_avg"]}
    del summary["machine"]["load_avg"]
    summary["seconds"] = round(time.time() - t0, 1)
    print("machine at end:", json.dumps(end), flush=True)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
