"""Target 4: one iteration of turn rows with their token lists written to and read back from Parquet.

The table holds the store's heavy columns (action ids and per-token log-probs as lists, 4 to 11
tokens a row) next to light ones; JSON lines of the same rows are written for a sample of at most
200,000 rows and scaled to the full count. Reading one light column must not touch the token lists:
its time is compared with reading the whole file.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.report import Figure

JSON_SAMPLE = 200_000


def make_table(rows: int) -> pa.Table:
    rng = np.random.default_rng(1)
    offsets = pa.array(np.r_[0, np.cumsum(rng.integers(4, 12, rows))], pa.int32())
    n = offsets[-1].as_py()
    return pa.table(
        {
            "rollout_id": np.arange(rows),
            "turn": np.zeros(rows, np.int32),
            "action": pa.array(["go to shelf 1"] * rows),
            "action_ids": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 150, n), pa.int32())),
            "logprobs": pa.ListArray.from_arrays(offsets, pa.array(-rng.random(n), pa.float32())),
            "reward": rng.random(rows),
            "won": rng.random(rows) < 0.1,
        }
    )


def run(rows: int) -> list[Figure]:
    table = make_table(rows)
    mb = table.nbytes / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        path, jsonl = Path(tmp) / "turns.parquet", Path(tmp) / "turns.jsonl"
        t0 = time.perf_counter()
        pq.write_table(table, path, compression="zstd")
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pq.read_table(path)
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pq.read_table(path, columns=["won"])
        column_s = time.perf_counter() - t0
        sample = min(rows, JSON_SAMPLE)
        with open(jsonl, "w") as fh:
            for row in table.slice(0, sample).to_pylist():
                fh.write(json.dumps(row) + "\n")
        ratio = jsonl.stat().st_size * rows / sample / path.stat().st_size
        size_mb = path.stat().st_size / 1e6
    share = column_s / read_s
    return [
        Figure(
            "store/write_MB_s",
            mb / write_s,
            "MB/s",
            "",
            None,
            f"{rows:,} rows, {mb:,.0f} MB in memory, {size_mb:,.1f} MB on disk (zstd)",
        ),
        Figure("store/read_MB_s", mb / read_s, "MB/s", "", None, "whole file"),
        Figure("store/jsonl_vs_parquet_size", ratio, "x", ">= 5", ratio >= 5, "JSON lines bytes / Parquet bytes"),
        Figure(
            "store/one_column_read_share",
            share,
            "frac",
            "< 0.1",
            share < 0.1,
            "time to read 'won' / time to read every column",
        ),
    ]
