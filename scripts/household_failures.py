"""How household episodes fail, won against lost, from a run's stored rollouts (docs/study.md).

    .venv/bin/python scripts/household_failures.py data/<experiment>/<run> 1 30

Per iteration given: the share of episodes that take an object of another type than the goal's target (and
whose first take is such an object), objects taken per episode, and the share of turns that repeat an
earlier action of the same episode. Reads the turns and episodes tables only; household tasks only (the
goal is rebuilt from each task's seed and tier, commands are read by the environment's own parser).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from horizonrl import store
from horizonrl.envs.household import parse_command
from horizonrl.envs.household_world import TIERS, generate_layout, kind_of


def episode_figures(actions: list[str], target: str) -> dict[str, float]:
    """One episode: does it take an object of a type other than ``target``, first or at all; how often it repeats
    itself."""
    taken = [kind_of(obj) for verb, obj, _ in map(parse_command, (a or "" for a in actions)) if verb == "take"]
    repeats = sum(a in actions[:i] for i, a in enumerate(actions))
    return {
        "takes": len(taken),
        "wrong_take": any(t != target for t in taken),
        "first_take_wrong": bool(taken) and taken[0] != target,
        "repeat_share": repeats / max(len(actions), 1),
    }


def iteration_figures(run: Path, iteration: int) -> pd.DataFrame:
    """Means over won and lost episodes of one iteration's collected rollouts."""
    folder = run / f"iter={iteration:05d}"
    turns = store.read_table(
        str(folder / "turns.parquet"), "turns", columns=["rollout_id", "turn", "action"]
    ).to_pandas()
    episodes = store.read_table(
        str(folder / "episodes.parquet"), "episodes", columns=["rollout_id", "won", "tier", "task_seed"]
    ).to_pandas()
    target = {e.rollout_id: generate_layout(e.task_seed, TIERS[e.tier]).goal.target for e in episodes.itertuples()}
    rows = {
        rid: episode_figures(list(g["action"]), target[rid])
        for rid, g in turns.sort_values(["rollout_id", "turn"]).groupby("rollout_id")
    }
    by_outcome = (
        pd.DataFrame.from_dict(rows, orient="index").join(episodes.set_index("rollout_id")["won"]).groupby("won")
    )
    return by_outcome.mean().assign(episodes=by_outcome.size())


if __name__ == "__main__":
    run_folder = Path(sys.argv[1])
    for it in map(int, sys.argv[2:]):
        print(f"iteration {it}\n{iteration_figures(run_folder, it).round(2)}\n")
