"""A study's record in the repository: what its results page is computed from, small enough to commit.

The MLflow store and the trajectory lake do not travel with the repository; these three CSV files do, and
the study's page (``study_page``) is generated from them alone, so anyone can recompute every figure:

- ``outcomes.csv``: one row per held-out episode of every evaluation of every cell: seed, method, iteration,
  task (the held-out task id), won (0/1), turns. From the cells' stored evaluations
  (``iter=<n>/eval-episodes.parquet``).
- ``progress.csv``: one row per cell and iteration: environment steps and training seconds so far, the
  iteration's and the evaluation's wall seconds, training success. From the cells' MLflow metrics.
- ``cells.csv``: one row per cell of the sweep file, finished or not: run name, status, iterations done,
  the warm start it started from and who played its starting evaluation; and one row per shared warm start
  (``method`` = ``warmstart``) with its wall seconds, from its run's start to its last epoch's logged loss.

A record only grows: a cell it shows finished keeps its rows when the store no longer has the run (a new
machine has the repository, not the store), and the sweep does not run that cell again (``finished_runs``).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from horizonrl.config import run_dir, warm_start_config
from horizonrl.config.sweep import Cell
from horizonrl.store import read_table
from horizonrl.tracking import mlflow_runs
from mlflow import MlflowClient

OUTCOMES, PROGRESS, CELLS = "outcomes.csv", "progress.csv", "cells.csv"
PROGRESS_METRICS = {
    "env_steps": "time/env_steps",  # cumulative, APPO's branches and replays included
    "train_s": "time/train_s",  # cumulative training wall time (evaluations excluded)
    "iteration_s": "time/iteration_s",
    "eval_s": "time/eval_s",
    "collect_success": "collect/success_rate",
}
EVAL0_TAG = "horizonrl.eval0.eval.played_by"


def cell_outcomes(folder: Path, seed: int, method: str) -> pd.DataFrame:
    """Every stored evaluation of the run in ``folder``, one row per held-out episode."""
    tables = []
    for path in sorted(folder.glob("iter=*/eval-episodes.parquet")):
        t = read_table(path, "episodes", ["iteration", "task_id", "won", "n_turns"]).to_pandas()
        tables.append(t.rename(columns={"task_id": "task", "n_turns": "turns"}))
    if not tables:
        return pd.DataFrame(columns=["seed", "method", "iteration", "task", "won", "turns"])
    out = pd.concat(tables, ignore_index=True)
    out.insert(0, "method", method)
    out.insert(0, "seed", seed)
    out["won"] = out["won"].astype(int)
    return out


def cell_progress(c: MlflowClient, run_id: str, seed: int, method: str) -> pd.DataFrame:
    """The cell's ``PROGRESS_METRICS`` by iteration (empty where a metric was not logged at one)."""
    columns = {
        name: {m.step: m.value for m in c.get_metric_history(run_id, key)} for name, key in PROGRESS_METRICS.items()
    }
    steps = sorted(set().union(*(h.keys() for h in columns.values())))
    rows = [
        {"seed": seed, "method": method, "iteration": i, **{k: h.get(i) for k, h in columns.items()}} for i in steps
    ]
    return pd.DataFrame(rows, columns=["seed", "method", "iteration", *PROGRESS_METRICS])


def export(cells: list[Cell], tracking_uri: str, out: Path) -> dict[str, int]:
    """Write the study's three files into ``out`` from the cells' runs (in the store at ``tracking_uri``) and
    folders; returns row counts."""
    c = mlflow_runs.client(tracking_uri)
    outcomes, progress, status = [], [], []
    warm_starts: dict[str, int] = {}
    for cell in cells:
        cfg = cell.config
        run = mlflow_runs.find_run(c, cfg.experiment, cfg.run_name)
        row = {"run_name": cfg.run_name, "seed": cfg.seed, "method": cfg.method, "status": "NOT STARTED"}
        if run is not None:
            last = c.get_metric_history(run.info.run_id, "time/iteration_s")
            row |= {
                "status": run.info.status,
                "iterations": max((m.step for m in last), default=0),
                "warm_start": run.data.tags.get(mlflow_runs.INIT_MODEL_TAG, ""),
                "eval0_played_by": run.data.tags.get(EVAL0_TAG, ""),
                "git_commit": run.data.tags.get("git_commit", ""),
            }
            outcomes.append(cell_outcomes(run_dir(cfg), cfg.seed, cfg.method))
            progress.append(cell_progress(c, run.info.run_id, cfg.seed, cfg.method))
        status.append(row)
        if cfg.warmstart.before_rl:
            warm_starts[warm_start_config(cfg).run_name] = cfg.seed
    for name, seed in sorted(warm_starts.items()):
        run = mlflow_runs.find_run(c, cells[0].config.experiment, name)
        epochs = c.get_metric_history(run.info.run_id, "clone/epoch_loss") if run is not None else []
        if epochs:  # from its start to its last epoch's loss (each later cell's no-op visit moves its end time)
            wall = (max(m.timestamp for m in epochs) - run.info.start_time) / 1000
            status.append(
                {"run_name": name, "seed": seed, "method": "warmstart", "status": run.info.status, "wall_s": wall}
            )
    out.mkdir(parents=True, exist_ok=True)
    tables = {
        OUTCOMES: pd.concat(outcomes, ignore_index=True) if outcomes else cell_outcomes(out, 0, ""),
        PROGRESS: pd.concat(progress, ignore_index=True) if progress else pd.DataFrame(),
        CELLS: pd.DataFrame(status),
    }
    if (out / CELLS).is_file():
        tables = _kept(dict(zip((OUTCOMES, PROGRESS, CELLS), load(out))), tables)
    for name, table in tables.items():
        table.to_csv(out / name, index=False, float_format="%.6g")
    return {name: len(table) for name, table in tables.items()}


def _kept(recorded: dict[str, pd.DataFrame], exported: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """``exported`` with every cell (and warm start) that ``recorded`` shows finished and ``exported`` does
    not: its recorded rows replace what the store holds of it (nothing, or a run begun again elsewhere). Rows
    stay in the cells' order, as an export from one store writes them."""
    old, new = recorded[CELLS], exported[CELLS]
    kept = old[(old["status"] == "FINISHED") & ~old["run_name"].isin(new.loc[new["status"] == "FINISHED", "run_name"])]
    if kept.empty:
        return exported
    position = {name: i for i, name in enumerate(dict.fromkeys([*new["run_name"], *old["run_name"]]))}
    cells = pd.concat([new[~new["run_name"].isin(kept["run_name"])], kept], ignore_index=True)
    cells = _ordered(cells, [position[name] for name in cells["run_name"]])
    rank = {(int(s), m): i for i, (s, m) in enumerate(zip(cells["seed"], cells["method"]))}
    keys = {(int(r.seed), r.method) for r in kept.itertuples() if r.method != "warmstart"}
    out = {CELLS: cells}
    for name in (OUTCOMES, PROGRESS):
        fresh, before = exported[name], recorded[name]
        parts = [t for t in (fresh[~_of_cells(fresh, keys)], before[_of_cells(before, keys)]) if not t.empty]
        if parts:
            t = pd.concat(parts, ignore_index=True)
            out[name] = _ordered(t, [rank[(int(s), m)] for s, m in zip(t["seed"], t["method"])])
        else:
            out[name] = fresh
    return out


def _ordered(table: pd.DataFrame, rank: list[int]) -> pd.DataFrame:
    """``table``'s rows sorted by ``rank`` (one per row), ties in their order."""
    return table.iloc[pd.Series(rank).argsort(kind="stable").to_numpy()].reset_index(drop=True)


def _of_cells(table: pd.DataFrame, keys: set[tuple[int, str]]) -> pd.Series:
    """Which rows of ``table`` (outcomes or progress) belong to the cells ``keys`` ((seed, method) each)."""
    return pd.Series([(int(s), m) in keys for s, m in zip(table.get("seed", []), table.get("method", []))],
                     index=table.index, dtype=bool)  # fmt: skip


def finished_runs(folder: Path) -> dict[str, int]:
    """{run name: iterations} of the cells the record in ``folder`` shows finished; empty before it is written."""
    if not (Path(folder) / CELLS).is_file():
        return {}
    cells = pd.read_csv(Path(folder) / CELLS)
    done = cells[(cells["status"] == "FINISHED") & (cells["method"] != "warmstart")]
    return {str(r.run_name): int(r.iterations) for r in done.itertuples()}


def load(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(outcomes, progress, cells) as ``export`` wrote them into ``folder``."""
    return tuple(pd.read_csv(Path(folder) / name) for name in (OUTCOMES, PROGRESS, CELLS))
