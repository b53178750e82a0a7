"""``make bench``: every ratio of the producer-connector and data-path issues, measured
side by side in one run. The last line printed is one JSON object.

  a/c   tiny-model prefill tokens/s with extraction + connector + reader, over the same
        vLLM without extraction;
  a/a0  the same over vLLM with extraction and no connector (the connector's own cost);
  e/b   the data path's ceiling (our connector's worker side driven with real vLLM
        objects, no model compute, GPU-sized states, into a reader that takes every
        sample on lease) over vLLM's ExampleHiddenStatesConnector into /dev/shm;
  d     e's bytes/s (checksums on, metrics on) over a raw NIXL WRITE of the same blocks;
  checksum_throughput_ratio  e with checksums over e without;
  metrics_throughput_ratio   e with metrics on (the connector's stats every step on both
        roles, the reader's endpoint scraped every second) over e with them off;
  step_ms / metadata_bytes   the connector's cost per engine step at 256 decoding
        requests with output tokens, at 2k and 32k context;
  reader_rss_mib  the reader's resident memory during e (its pool, plus the rest).
  values_check_GB_per_s  the reader's optional NaN/Inf/all-zero check on one thread, over
        a sample of e's shape as the reader hands it out.
"""

from __future__ import annotations

import json
import os
import time


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from scripts import bench_datapath, bench_model, bench_step
    from scripts.env_report import describe

    t0 = time.time()
    model = bench_model.main()
    print("model-level:", json.dumps(model, indent=1), flush=True)
    datapath = bench_datapath.main()
    print("data path:", json.dumps(datapath, indent=1), flush=True)
    steps = bench_step.main()
    print("per step:", json.dumps(steps, indent=1), flush=True)
    summary = {
        "a_over_c": round(model["a_over_c"], 3),
        "a_over_a0": round(model["a_over_a0"], 3),
        "e_over_b": round(datapath["e_over_b"], 3),
        "d": round(datapath["d"], 3),
        "checksum_throughput_ratio": round(datapath["checksum_throughput_ratio"], 3),
        "metrics_throughput_ratio": round(datapath["metrics_throughput_ratio"], 3),
        "a_tokens_per_s": round(model["a_extract_connector_reader"]["tokens_per_s"]),
        "c_tokens_per_s": round(model["c_no_extraction"]["tokens_per_s"]),
        "e_tokens_per_s": round(datapath["e_ours"]["tokens_per_s"]),
        "e_GB_per_s": round(datapath["e_ours"]["GB_per_s"], 3),
        "b_tokens_per_s": round(datapath["b_example_shm"]["tokens_per_s"]),
        "raw_nixl_GB_per_s": round(datapath["r_raw_nixl"]["GB_per_s"], 3),
        "a0_tokens_per_s": round(model["a0_extract_no_connector"]["tokens_per_s"]),
        "step_ms": {k: round(v["step_ms"], 3) for k, v in steps.items()},
        "metadata_bytes": {k: int(v["metadata_bytes"]) for k, v in steps.items()},
        "reader_rss_mib": round(datapath["e_ours"]["reader_rss_mib"]),
        "reader_pool_mib": round(datapath["e_ours"]["reader_pool_mib"]),
        "values_check_GB_per_s": round(datapath["values_check"]["GB_per_s"], 2),
        "host": describe(),
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
