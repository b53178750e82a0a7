"""The fp8 file writer (``python -m kv_connector.reader --fp8``), for ``make bench``:

1. Its cost, paired (``scripts.bench.paired``): rows/s and bytes per row of the reader CLI's
   own ``write_sample`` (atomic, fsynced) in speculators' fp8 layout over the same rows
   as bf16 files, into one directory on this machine's disk.
2. What the two scalings cost in accuracy: per captured layer, the worst relative error
   (over tokens, L2 over hidden) of the dequantized states against the bf16 ones, with one
   scale per token (speculators' layout) and one per token and layer (our variant), on a
   real-looking sample (``real_looking``).

    python -m scripts.bench.fp8          # prints one JSON line
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kv_connector.files.cli import write_sample
from kv_connector.files.fp8 import Fp8Scale, worst_relative_error
from kv_connector.reader import Sample
from scripts.bench.paired import Run, cpu_seconds, run_pairs

HIDDEN = 4096  # Llama-3.1-8B's
LAYER_IDS = [2, 16, 29, 32]  # EAGLE-3's captures of a 32-layer target (the last before its norm)


def real_looking(tokens: int = 2048, seed: int = 0) -> torch.Tensor:
    """[T, 4, 4096] bf16 states shaped as a decoder's residual stream is reported to be
    (no weights can be fetched here, so none is a real model's): the RMS grows with depth
    (0.04, 0.6, 2, 4.5 at layers 2, 16, 29, 32); six channels are 20 times larger from
    the middle layers on (outlier features); two tokens, the first and one delimiter,
    carry massive activations of 300 to 2500 in two of those channels from layer 2 on
    (Sun et al., "Massive Activations in Large Language Models", 2024)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, len(LAYER_IDS), HIDDEN, generator=g)
    x *= torch.tensor([0.04, 0.6, 2.0, 4.5]).view(1, -1, 1)
    channels = torch.randperm(HIDDEN, generator=g)[:6]
    x[:, 1:, channels] *= 20
    for t in (0, min(57, tokens - 1)):
        x[t, :, channels[:2]] = torch.tensor([300.0, 1500.0, 2000.0, 2500.0]).unsqueeze(1)
    return x.to(torch.bfloat16)


def error_study(tokens: int = 2048) -> dict[str, Any]:
    """Both scalings' worst relative error per captured layer, on the real-looking sample
    and on its ordinary tokens alone (the two massive ones left out)."""
    states = real_looking(tokens)
    ordinary = torch.cat([states[1:57], states[58:]]) if tokens > 58 else states[1:]
    out: dict[str, Any] = {"layer_ids": LAYER_IDS}
    for name, sample in (("all_tokens", states), ("ordinary_tokens", ordinary)):
        out[name] = {s.value: [round(v, 4) for v in worst_relative_error(sample, s)] for s in Fp8Scale}
    return out


def _writer_arm(out: Path, rows: list[torch.Tensor], fp8: Fp8Scale | None) -> Any:
    tmp = out / ".tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    tokens = torch.arange(rows[0].shape[0], dtype=torch.int64)

    def run() -> Run:
        c0, t0 = cpu_seconds(), time.perf_counter()
        nbytes = 0
        for i, states in enumerate(rows):
            sample = Sample(f"r{i}", tokens, states, tuple(LAYER_IDS), sample_id=str(i))
            path = write_sample(out / f"hs_{i}.safetensors", sample, tmp, fp8=fp8)
            nbytes += path.stat().st_size
        return Run(time.perf_counter() - t0, float(len(rows)), float(nbytes), cpu_seconds() - c0)

    return run


def writer(rows: int = 8, tokens: int = 1024, pairs: int = 5, where: Path | None = None) -> dict[str, Any]:
    """fp8 files (one scale per token) over bf16 files: rows/s and bytes per row, paired."""
    data = [real_looking(tokens, seed=i) for i in range(rows)]
    base = Path(tempfile.mkdtemp(prefix="bench-fp8-", dir=where))
    try:
        fp8_arm = _writer_arm(base / "fp8", data, Fp8Scale.TOKEN)
        bf16_arm = _writer_arm(base / "bf16", data, None)
        got = run_pairs(fp8_arm, bf16_arm, pairs=pairs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    per_row = got.each("a", lambda r: r.nbytes / r.units).median
    per_row_bf16 = got.each("b", lambda r: r.nbytes / r.units).median
    ratio = got.ratio()
    return {
        "fp8_rows_per_s_over_bf16": ratio.rounded()[0],
        "fp8_rows_per_s_over_bf16_range": ratio.rounded()[1],
        "fp8_rows_per_s": round(got.each("a").median, 2),
        "bf16_rows_per_s": round(got.each("b").median, 2),
        "fp8_bytes_per_row": int(per_row),
        "bf16_bytes_per_row": int(per_row_bf16),
        "fp8_bytes_over_bf16": round(per_row / per_row_bf16, 4),
        "row": {"tokens": tokens, "layers": len(LAYER_IDS), "hidden": HIDDEN},
    }


def main() -> dict[str, Any]:
    return {"writer": writer(), "error": error_study()}


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
