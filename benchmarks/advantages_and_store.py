"""Benchmark (issue 8, targets 3 and 4): advantage estimators at scale and the Parquet store.

Prints a table of figures measured side by side in one run:
* each estimator on N turn rows in G groups, against a plain per-group Python loop over the same data
  (the reference), as time and speed-up;
* one iteration of N turn rows with token lists written and read back as Parquet (MB/s both ways), the
  file size against the same rows as JSON lines, and whether reading one column skips the token lists.

Run: ``.venv/bin/python -m benchmarks.advantages_and_store [--rows 1000000 --groups 100000]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import methods
from horizonrl import store
from methods import StepBatch


def make_batch(rows: int, groups: int, seed: int = 0) -> StepBatch:
    """Trajectory-level batch: every row its own trajectory (the cheapest layout for the loop too)."""
    rng = np.random.default_rng(seed)
    group_id = np.sort(rng.integers(0, groups, rows))
    ret = rng.integers(0, 2, rows).astype(np.float64)
    return StepBatch(group_id=group_id, traj_id=np.arange(rows), turn=np.zeros(rows, np.int64), reward=ret,
                     episode_return=ret, n_tokens=np.full(rows, 4, np.int64))


def loop_reference(name: str, batch: StepBatch) -> np.ndarray:
    """A plain per-group Python loop (the speed reference)."""
    out = np.zeros(len(batch))
    members: dict[int, list[int]] = {}
    for i, g in enumerate(batch.group_id.tolist()):
        members.setdefault(g, []).append(i)
    R = batch.episode_return
    for idx in members.values():
        r = R[idx]
        K = len(idx)
        if name == "loo":
            out[idx] = 0.0 if K < 2 else K / (K - 1) * (r - r.mean())
        elif name == "rloo":
            out[idx] = r if K < 2 else K / (K - 1) * (r - r.mean())
        else:  # grpo
            out[idx] = r / (1 + 1e-6) if K < 2 else (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    return out


def bench_advantages(rows: int, groups: int) -> list[tuple[str, float, float]]:
    batch = make_batch(rows, groups)
    results = []
    for name in ("loo", "grpo", "rloo"):
        entry = methods.ADVANTAGES.get(name)
        t0 = time.perf_counter()
        res = entry.fn(batch, entry.params_cls(), None)
        fast = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = loop_reference(name, batch)
        slow = time.perf_counter() - t0
        assert np.allclose(res.adv, ref, rtol=1e-5, atol=1e-9), name
        results.append((name, fast, slow))
    return results


def bench_store(rows: int, folder: Path) -> dict[str, float]:
    rng = np.random.default_rng(1)
    lengths = rng.integers(4, 12, rows)
    offsets = np.r_[0, np.cumsum(lengths)]
    ids = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(rng.integers(0, 150, offsets[-1]), pa.int32()))
    lp = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(-rng.random(offsets[-1]), pa.float32()))
    table = pa.table({"rollout_id": np.arange(rows), "turn": np.zeros(rows, np.int32), "action": pa.array(["go to shelf 1"] * rows),
                      "action_ids": ids, "logprobs": lp, "reward": rng.random(rows), "won": rng.random(rows) < 0.1})
    path = folder / "turns.parquet"
    t0 = time.perf_counter()
    pq.write_table(table, path, compression="zstd")
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pq.read_table(path)
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pq.read_table(path, columns=["won"])
    column_s = time.perf_counter() - t0
    jsonl = folder / "turns.jsonl"
    with open(jsonl, "w") as f:
        for row in table.slice(0, min(rows, 200_000)).to_pylist():
            f.write(json.dumps(row) + "\n")
    json_size = jsonl.stat().st_size * rows / min(rows, 200_000)
    mb = table.nbytes / 1e6
    return {"write_MB_s": mb / write_s, "read_MB_s": mb / read_s, "size_vs_jsonl": json_size / path.stat().st_size,
            "one_column_share_of_full_read": column_s / read_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--groups", type=int, default=100_000)
    args = parser.parse_args()
    print(f"{'figure':<44}{'value':>12}{'target':>14}  result")
    for name, fast, slow in bench_advantages(args.rows, args.groups):
        print(f"{'advantage ' + name + ' seconds':<44}{fast:>12.3f}{'< 0.5':>14}  {'pass' if fast < 0.5 else 'miss'}")
        print(f"{'advantage ' + name + ' speed-up over loop':<44}{slow / fast:>12.1f}{'>= 20':>14}  {'pass' if slow / fast >= 20 else 'miss'}")
    with tempfile.TemporaryDirectory() as tmp:
        s = bench_store(args.rows, Path(tmp))
    print(f"{'store write MB/s':<44}{s['write_MB_s']:>12.1f}{'report':>14}")
    print(f"{'store read MB/s':<44}{s['read_MB_s']:>12.1f}{'report':>14}")
    print(f"{'store size: JSON lines / Parquet':<44}{s['size_vs_jsonl']:>12.1f}{'>= 5':>14}  {'pass' if s['size_vs_jsonl'] >= 5 else 'miss'}")
    print(f"{'read one column / read all (time)':<44}{s['one_column_share_of_full_read']:>12.3f}{'small':>14}")
    print(f"(schema of the real store: {len(store.TURNS.names)} turn columns; this benchmark writes the heavy ones)")


if __name__ == "__main__":
    main()
