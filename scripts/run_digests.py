"""Digests of everything a run computed, to check that a change leaves a seed's results bit for bit alone.

    python scripts/run_digests.py DATA_DIR > before.txt    # on the old code, after a short run
    python scripts/run_digests.py DATA_DIR > after.txt     # the same run on the new code
    diff before.txt after.txt                              # lines only in after.txt: files the old code lacked

One line per file under ``DATA_DIR``: every Parquet table's columns (timings left out: ``*_s`` columns and
columns named after time), every safetensors file's tensors and every optimizer state's tensors, each as
a sha256 of their values. Files that only the new code writes show as added lines, not as changes.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from safetensors.numpy import load_file


def _timing(column: str) -> bool:
    return column.endswith("_s") or "time" in column or "wall" in column


def table_digest(path: Path) -> str:
    table = pq.read_table(path)
    h = hashlib.sha256()
    for name in (c for c in table.column_names if not _timing(c)):
        h.update(name.encode())
        h.update(repr(table.column(name).to_pylist()).encode())
    return f"{table.num_rows} rows {h.hexdigest()[:16]}"


def tensors_digest(path: Path) -> str:
    h = hashlib.sha256()
    if path.suffix == ".safetensors":
        tensors = load_file(path)
        for name in sorted(tensors):
            h.update(name.encode())
            h.update(tensors[name].tobytes())
    else:
        _update(h, torch.load(path, weights_only=True))
    return h.hexdigest()[:16]


def _update(h: Any, value: object) -> None:
    """Hash a nested optimizer state: tensors by their bytes, containers in key order, the rest by repr."""
    if isinstance(value, torch.Tensor):
        h.update(value.detach().cpu().numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            h.update(str(key).encode())
            _update(h, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _update(h, item)
    else:
        h.update(repr(value).encode())


def main(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.suffix == ".parquet":
            print(path.relative_to(root), table_digest(path))
        elif path.suffix == ".safetensors" or path.name == "optimizer.pt":
            print(path.relative_to(root), tensors_digest(path))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        raise SystemExit("usage: python scripts/run_digests.py DATA_DIR")
    main(Path(sys.argv[1]))
