"""The rows a data-generation run sends: a dataset's ``input_ids`` column (a Hugging Face
``datasets`` directory) or a JSON-lines file, each row's token ids checked as read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from kv_connector.common.errors import ConfigurationError


class Rows(Protocol):
    def __len__(self) -> int: ...

    def tokens(self, row: int) -> list[int]: ...

    def lengths(self) -> list[int]: ...


class DatasetRows:
    """Rows of a ``datasets`` directory (``save_to_disk``; speculators' ``prepare_data``
    output) with an ``input_ids`` column, read row by row."""

    def __init__(self, path: Path) -> None:
        try:
            import datasets
        except ImportError:
            raise ConfigurationError(
                "reading a datasets directory needs the `datasets` package (pip install datasets, or "
                "PYTHONPATH=.venv/speculators-site-packages; see docs/usage.md), or use --jsonl"
            ) from None
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise ConfigurationError(f"cannot load the dataset {path}: {e}") from None
        if not isinstance(ds, datasets.Dataset):
            raise ConfigurationError(
                f"{path} holds several splits ({', '.join(ds)}); give one split's directory"
            )
        if "input_ids" not in ds.column_names:
            raise ConfigurationError(
                f"{path} has no input_ids column (columns: {', '.join(ds.column_names)})"
            )
        self._ds = ds.with_format(None)
        self._arrow = ds.with_format("arrow")

    def __len__(self) -> int:
        return len(self._ds)

    def tokens(self, row: int) -> list[int]:
        return check_tokens(self._ds[row]["input_ids"], row)

    def lengths(self) -> list[int]:
        import pyarrow.compute as pc

        column = self._arrow[0 : len(self._arrow)]["input_ids"]
        return [int(x) for x in pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)]


class JsonlRows:
    """Rows of a JSON-lines file, one ``{"input_ids": [...]}`` object per line (row i is
    the i-th line that is not blank)."""

    def __init__(self, path: Path) -> None:
        self._rows: list[list[int]] = []
        try:
            with open(path) as f:
                for n, text in enumerate(f, 1):
                    if not text.strip():
                        continue
                    try:
                        obj = json.loads(text)
                    except json.JSONDecodeError as e:
                        raise ConfigurationError(f"{path}:{n}: not JSON: {e}") from None
                    if not isinstance(obj, dict) or "input_ids" not in obj:
                        raise ConfigurationError(f"{path}:{n}: not an object with input_ids")
                    self._rows.append(check_tokens(obj["input_ids"], len(self._rows)))
        except OSError as e:
            raise ConfigurationError(f"cannot read {path}: {e.strerror or e}") from None

    def __len__(self) -> int:
        return len(self._rows)

    def tokens(self, row: int) -> list[int]:
        return self._rows[row]

    def lengths(self) -> list[int]:
        return [len(r) for r in self._rows]


def check_tokens(ids: object, row: int) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ConfigurationError(f"row {row}: input_ids must be a non-empty list of token ids")
    return ids
