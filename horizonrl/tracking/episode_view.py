"""Stored episodes as text for the terminal (``horizonrl show``): a look at the data without code.

Reads the Parquet store only: an iteration's episodes as a list, or one episode turn by turn with its
observation, action, reward and the advantage of every method computed over it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from horizonrl import store


def iteration_dir(run_dir: str | Path, iteration: int) -> Path:
    """``<run_dir>/iter=<n>``; the error names the iterations that are stored."""
    d = Path(run_dir) / f"iter={iteration:05d}"
    if not (d / "episodes.parquet").is_file():
        stored = sorted(
            int(p.name.split("=")[1]) for p in Path(run_dir).glob("iter=*") if (p / "episodes.parquet").is_file()
        )
        raise ValueError(
            f"{run_dir}: iteration {iteration} is not stored (stored: {', '.join(map(str, stored)) or 'none'})"
        )
    return d


def _advantages(d: Path) -> pd.DataFrame:
    """(rollout_id, turn) -> one ``adv_<method>`` column per advantages table of the iteration."""
    merged = None
    for path in sorted(d.glob("advantages-*.parquet")):
        method = path.stem.removeprefix("advantages-")
        table = (
            store.read_table(path, "advantages", columns=["rollout_id", "turn", "adv"])
            .to_pandas()
            .rename(columns={"adv": f"adv_{method}"})
        )
        merged = table if merged is None else merged.merge(table, on=["rollout_id", "turn"], how="outer")
    return merged if merged is not None else pd.DataFrame(columns=["rollout_id", "turn"])


def iteration_text(run_dir: str | Path, iteration: int) -> str:
    """One line per episode of the iteration: rollout id, group, task, return, turns, status."""
    ep = store.read_table(iteration_dir(run_dir, iteration) / "episodes.parquet", "episodes").to_pandas()
    lines = [
        f"iteration {iteration}: {len(ep)} episodes, success {ep['won'].mean():.3f}, mean return "
        f"{ep['episode_return'].mean():.3f}",
        f"{'episode':>8} {'group':>6}  {'task':<32}{'return':>8} {'turns':>6}  {'kind':<8}status",
    ]
    for e in ep.itertuples():
        lines.append(
            f"{e.rollout_id:>8} {e.group_id:>6}  {e.task_id:<32}{e.episode_return:>8.3f} {e.n_turns:>6}  "
            f"{e.kind:<8}{e.status}"
        )
    return "\n".join(lines)


def episode_text(run_dir: str | Path, iteration: int, rollout_id: int) -> str:
    """The episode turn by turn: observation, action, reward and each stored method's advantage."""
    d = iteration_dir(run_dir, iteration)
    ep = store.read_table(d / "episodes.parquet", "episodes").to_pandas()
    row = ep[ep["rollout_id"] == rollout_id]
    if row.empty:
        raise ValueError(f"{d}: no episode {rollout_id} (episodes {ep['rollout_id'].min()}-{ep['rollout_id'].max()})")
    e = row.iloc[0]
    turns = store.read_table(
        d / "turns.parquet", "turns", columns=["rollout_id", "turn", "observation", "action", "reward", "valid"]
    ).to_pandas()
    turns = (
        turns[turns["rollout_id"] == rollout_id]
        .merge(_advantages(d), on=["rollout_id", "turn"], how="left")
        .sort_values("turn")
    )
    lines = [
        f"episode {rollout_id} of iteration {iteration} (group {e['group_id']}, {e['kind']}): task {e['task_id']}, "
        f"return {e['episode_return']:.3f}, {'won' if e['won'] else 'not won'}, {e['n_turns']} turns, {e['status']}"
    ]
    adv_columns = [c for c in turns.columns if c.startswith("adv_")]
    for t in turns.itertuples():
        figures = [
            f"reward {t.reward:g}",
            *(f"advantage ({c[4:]}) {getattr(t, c):+.4f}" for c in adv_columns),
            *([] if t.valid else ["invalid action"]),
        ]
        lines += [
            "",
            f"--- turn {t.turn}: {', '.join(figures)}",
            f"observation: {t.observation.strip()}",
            f"action:      {t.action.strip()}",
        ]
    return "\n".join(lines)
