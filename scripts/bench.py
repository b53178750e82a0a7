"""``make bench``: every ratio of the producer-connector issue, measured side by side in
one run. The last line printed is one JSON object with a_over_c, e_over_b and d.

  a/c  tiny-model prefill tokens/s with extraction + connector + reader, over the same
       vLLM without extraction (what the connector costs the producer);
  e/b  the data path's ceiling (our connector's worker side driven with real vLLM
       objects, no model compute, GPU-sized states, into a reader) over vLLM's
       ExampleHiddenStatesConnector driven the same way into /dev/shm;
  d    e's bytes/s over a raw NIXL WRITE of the same blocks on the same link.
"""

from __future__ import annotations

import json
import os
import platform
import time


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from scripts import bench_datapath, bench_model

    t0 = time.time()
    model = bench_model.main()
    print("model-level:", json.dumps(model, indent=1), flush=True)
    datapath = bench_datapath.main()
    print("data path:", json.dumps(datapath, indent=1), flush=True)
    summary = {
        "a_over_c": round(model["a_over_c"], 3),
        "e_over_b": round(datapath["e_over_b"], 3),
        "d": round(datapath["d"], 3),
        "checksum_throughput_ratio": round(datapath["checksum_throughput_ratio"], 3),
        "a_tokens_per_s": round(model["a_extract_connector_reader"]["tokens_per_s"]),
        "c_tokens_per_s": round(model["c_no_extraction"]["tokens_per_s"]),
        "e_tokens_per_s": round(datapath["e_ours"]["tokens_per_s"]),
        "e_GB_per_s": round(datapath["e_ours"]["GB_per_s"], 3),
        "b_tokens_per_s": round(datapath["b_example_shm"]["tokens_per_s"]),
        "raw_nixl_GB_per_s": round(datapath["r_raw_nixl"]["GB_per_s"], 3),
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
