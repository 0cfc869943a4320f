"""How household episodes fail, won against lost, from a run's stored rollouts (README, "Warm start and the study").

    .venv/bin/python scripts/household_failures.py data/<experiment>/<run> 1 30

Per iteration given: the share of episodes that take an object the goal does not name (and whose first
take is such an object), objects taken per episode, and the share of turns that repeat an earlier action
of the same episode. Reads the turns and episodes tables only; household goals and commands only.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd

from horizonrl import store

GOAL = re.compile(r"your task is to : (.*?) \.")
TAKE = re.compile(r"take (\w+) \d+ from ")


def episode_figures(actions: list[str], first_observation: str) -> dict[str, float]:
    """One episode: does it take an object type absent from the goal's words, first or at all; how often it repeats itself."""
    goal_words = set(GOAL.search(first_observation).group(1).split())
    taken = [m.group(1) for a in actions if (m := TAKE.match(a or ""))]
    repeats = sum(a in actions[:i] for i, a in enumerate(actions))
    return {"takes": len(taken), "wrong_take": any(t not in goal_words for t in taken),
            "first_take_wrong": bool(taken) and taken[0] not in goal_words, "repeat_share": repeats / max(len(actions), 1)}


def iteration_figures(run: Path, iteration: int) -> pd.DataFrame:
    """Means over won and lost episodes of one iteration's collected rollouts."""
    folder = run / f"iter={iteration:05d}"
    turns = store.read_table(str(folder / "turns.parquet"), "turns", columns=["rollout_id", "turn", "observation", "action"]).to_pandas()
    won = store.read_table(str(folder / "episodes.parquet"), "episodes", columns=["rollout_id", "won"]).to_pandas().set_index("rollout_id")["won"]
    rows = {rid: episode_figures(list(g["action"]), g["observation"].iloc[0]) for rid, g in turns.sort_values(["rollout_id", "turn"]).groupby("rollout_id")}
    figures = pd.DataFrame.from_dict(rows, orient="index").join(won)
    return figures.groupby("won").mean().assign(episodes=figures.groupby("won").size())


if __name__ == "__main__":
    run_folder = Path(sys.argv[1])
    for it in map(int, sys.argv[2:]):
        print(f"iteration {it}\n{iteration_figures(run_folder, it).round(2)}\n")
