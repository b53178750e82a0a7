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


def main() -> int:
    cmd, data_dir = sys.argv[1], Path(sys.argv[2])
    if cmd == "write":
        write(data_dir, json.loads(Path(sys.argv[3]).read_text()))
        return 0
    print(json.dumps(load(data_dir, Path(sys.argv[3]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
