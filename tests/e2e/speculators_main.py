"""speculators' side of tests/e2e/test_speculators.py, in a process of its own whose
PYTHONPATH holds speculators and its imports (``.venv/speculators-site-packages``), so the
test's own process and vLLM's keep their environment.

    speculators_main.py write DATA_DIR ROWS_JSON   a datasets directory as prepare_data
                                                    writes it: input_ids, loss_mask,
                                                    seq_len, torch format, save_to_disk
    speculators_main.py load DATA_DIR OUT_FILE     every row through speculators' own
                                                    ArrowDataset + hs_connectors.FileTransfer
                                                    (on_missing="raise") and its own file
                                                    checks; what it loaded goes to OUT_FILE
                                                    (safetensors), a JSON report to stdout
    speculators_main.py fp8 HS_DIR ORIG_FILE       each row of ORIG_FILE ("<row>.hidden_states"
                                                    as the producer had them) through
                                                    hs_connectors.FP8Transfer.get_cached, and
                                                    each file's fp8 bytes against
                                                    fp8_utils.quantize_tensor_to_fp8 of the
                                                    original; a JSON report to stdout
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write(data_dir: Path, rows: list[list[int]]) -> None:
    from datasets import Dataset

    masks = [[0] * (len(r) // 2) + [1] * (len(r) - len(r) // 2) for r in rows]
    ds = Dataset.from_dict({"input_ids": rows, "loss_mask": masks, "seq_len": [len(r) for r in rows]})
    ds.set_format(type="torch")  # what prepare_data does; ArrowDataset needs it
    ds.save_to_disk(str(data_dir))


def load(data_dir: Path, out_file: Path) -> dict[str, object]:
    import torch
    from datasets import load_from_disk
    from hs_connectors import FileTransfer
    from safetensors.torch import save_file
    from speculators.data_generation.offline import (
        check_hidden_states,
        find_corrupt_hidden_state_indices,
        get_existing_hidden_state_indices,
    )
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    hs_dir = data_dir / "hidden_states"
    rows = load_from_disk(str(data_dir))
    n = len(rows)
    existing = get_existing_hidden_state_indices(hs_dir)
    corrupt = find_corrupt_hidden_state_indices(hs_dir, list(range(n)))
    dataset = ArrowDataset(
        max_len=4096, datapath=str(data_dir), transfer=FileTransfer(hs_dir), on_missing="raise"
    )
    tensors: dict[str, torch.Tensor] = {}
    unavailable = {}
    for i in range(n):
        item = dataset[i]
        if isinstance(item, SampleUnavailable):
            unavailable[i] = item.reason
            continue
        raw = FileTransfer(hs_dir).get_cached(i)
        assert raw is not None
        check_hidden_states(raw, rows[i]["input_ids"].tolist())  # raises ValueError if not
        assert torch.equal(item["loss_mask"], rows[i]["loss_mask"])
        for k in ("hidden_states", "verifier_last_hidden_states", "input_ids"):
            tensors[f"{i}.{k}"] = item[k].contiguous()
    save_file(tensors, str(out_file))
    return {"rows": n, "existing": existing, "corrupt": corrupt, "unavailable": unavailable}


def fp8(hs_dir: Path, orig_file: Path) -> dict[str, object]:
    import torch
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
    from hs_connectors.transfer import FP8Transfer
    from safetensors import safe_open
    from safetensors.torch import load_file

    originals = load_file(str(orig_file))
    rows = sorted(int(k.split(".")[0]) for k in originals)
    transfer = FP8Transfer(hs_dir, dequantize_dtype=torch.bfloat16)
    report: dict[str, object] = {"rows": len(rows), "byte_exact": [], "within_tolerance": [], "scales": []}
    for i in rows:
        want = originals[f"{i}.hidden_states"]
        got = transfer.get_cached(i)
        assert got is not None and SCALES_KEY not in got, f"row {i}"
        assert got["hidden_states"].dtype == torch.bfloat16 and got["hidden_states"].shape == want.shape
        close = torch.allclose(got["hidden_states"].float(), want.float(), atol=0.5, rtol=0.1)  # its tests'
        report["within_tolerance"].append(close)  # type: ignore[union-attr]
        with safe_open(str(hs_dir / f"hs_{i}.safetensors"), "pt") as f:
            stored, scales = f.get_tensor("hidden_states"), f.get_tensor(SCALES_KEY)
        ref, ref_scales = quantize_tensor_to_fp8(want)
        exact = torch.equal(stored.view(torch.uint8), ref.view(torch.uint8)) and torch.equal(
            scales, ref_scales
        )
        report["byte_exact"].append(exact)  # type: ignore[union-attr]
        report["scales"].append(list(scales.shape))  # type: ignore[union-attr]
    return report


def main() -> int:
    cmd, data_dir = sys.argv[1], Path(sys.argv[2])
    if cmd == "fp8":
        print(json.dumps(fp8(data_dir, Path(sys.argv[3]))), flush=True)
        return 0
    if cmd == "write":
        write(data_dir, json.loads(Path(sys.argv[3]).read_text()))
        return 0
    print(json.dumps(load(data_dir, Path(sys.argv[3]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
