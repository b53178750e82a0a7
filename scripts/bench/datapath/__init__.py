"""Data-path ceiling on GPU-sized states (4 captured layers x hidden 4096, bf16: 32 KiB
per token), with no model compute, every ratio from alternating pairs (``scripts.bench.paired``):

  e: our connector's worker side driven with real vLLM objects (scripts.support.vllm_harness)
     into a HiddenStatesReader in another process that takes every sample on lease, with
     the default integrity record (fingerprints taken in the step that wrote each slot);
  ex: e with the diagnostic full hash ("checksum": "xxh3": every byte at both ends);
  b: vLLM's ExampleHiddenStatesConnector driven the same way, writing safetensors files
     to /dev/shm (a minimal CPU-safe subclass: the stock one needs CUDA);
  r: a raw NIXL WRITE of the same blocks from the same kind of registered cache into
     another process's registered memory (no protocol, no hand-out).

Each arm is a pair of long-lived processes (producer, consumer) started once; a round is
one measurement on command, so a pair costs the transfer, not vLLM's import. Every round
reports the CPU seconds both processes spent in it (their own rusage), which on a shared
machine is far steadier than bytes per second.

  rc: r with XXH3 at both ends (each sample hashed from the cache as its WRITE is posted,
     and from the pool as it lands, each on a thread of its own): the ceiling of d and
     of the checksum ratio on this machine for any design that checks every byte.
  ra: r from a cache of as many samples as e's (4) whose blocks are written again only once
     the target acknowledged the sample (an ack on a pipe, sent as its notification is
     seen): the ceiling of d on this machine for any design that keeps a sample's blocks
     until its reader has it, as ours does so that a reader's restart loses nothing.

Figures: d = e's bytes/s over r's; cpu_over_raw = e's CPU seconds per GB over r's;
d_xxh3 and cpu_over_raw_xxh3 the same of ex (beside their ceilings below);
acked_raw_over_raw = ra over r (d's ceiling); xxh3_ceiling = rc over r, xxh3_cpu_floor =
rc's CPU seconds per GB over r's (the least cpu_over_raw can be for a design that checks
every byte);
checksum_throughput_ratio = e over e without an integrity record; metrics_throughput_ratio = e
(the connector's stats taken every step on both roles as vLLM does, the reader's endpoint
scraped every second) over e with metrics off; e_over_b. Also what the reader's optional
values check (``reader.pool.values``: NaN/Inf, all-zero tokens) costs per sample of the same
shape, beside the XXH3 checksum's pass over the same bytes.

The modules: ``ours`` (e, and its reader process), ``example`` (b), ``raw`` (r and rc, and
the target process the GPU check borrows), ``drive`` (how e and b feed a harness rank),
``values`` (the values check), ``arm_process`` (each arm in a process of its own, run a
round at a time; the arms it can build by name), ``shape`` (the sizes all share) and
``run`` (the pairings and their figures, as ``make bench`` runs them).

``python -m scripts.bench.datapath`` prints progress to stderr and the result JSON (the keys
of ``make bench``'s "data path:" line) as its last stdout line.
"""

from scripts.bench.datapath.arm_process import ArmProcess, isolated, one_round
from scripts.bench.datapath.example import ExampleArm
from scripts.bench.datapath.ours import OursArm
from scripts.bench.datapath.raw import RawArm, raw_target_proc
from scripts.bench.datapath.run import main
from scripts.bench.datapath.shape import BLOCK, HIDDEN, LAYERS, TOKEN_BYTES
from scripts.bench.datapath.values import bench_values_check

__all__ = [
    "BLOCK",
    "HIDDEN",
    "LAYERS",
    "TOKEN_BYTES",
    "ArmProcess",
    "ExampleArm",
    "OursArm",
    "RawArm",
    "bench_values_check",
    "isolated",
    "main",
    "one_round",
    "raw_target_proc",
]
