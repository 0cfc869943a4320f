"""Figures over a list of episodes, shared by the collect and evaluate stages (same names, same meaning)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pandas as pd

from horizonrl.rollout import EpisodeRecord


def episode_metrics(records: list[EpisodeRecord]) -> dict[str, float]:
    """success_rate, mean_return, mean_turns, invalid_rate, tokens_per_episode, error_rate, episodes."""
    if not records:
        return {"episodes": 0.0}
    turns = [len(r.turns) for r in records]
    n_turns = max(sum(turns), 1)
    return {
        "episodes": float(len(records)),
        "success_rate": float(np.mean([r.won for r in records])),
        "mean_return": float(np.mean([r.episode_return for r in records])),
        "mean_turns": float(np.mean(turns)),
        "invalid_rate": sum(not t.valid for r in records for t in r.turns) / n_turns,
        "tokens_per_episode": float(np.mean([sum(len(t.gen.token_ids) for t in r.turns) for r in records])),
        "error_rate": float(np.mean([r.status == "error" for r in records])),
    }


def pass_at_k(records: list[EpisodeRecord]) -> float:
    """Share of tasks (groups) with at least one won rollout."""
    by_group: dict[int, bool] = defaultdict(bool)
    for r in records:
        by_group[r.group_id] |= r.won
    return float(np.mean(list(by_group.values()))) if by_group else 0.0


def mixed_group_fraction(records: list[EpisodeRecord]) -> float:
    """Share of task groups whose returns are not all equal (the groups that carry learning signal)."""
    returns: dict[int, set[float]] = defaultdict(set)
    for r in records:
        returns[r.group_id].add(r.episode_return)
    return float(np.mean([len(v) > 1 for v in returns.values()])) if returns else 0.0


def sample_episodes(records: list[EpisodeRecord], n: int = 8) -> pd.DataFrame:
    """A few episodes as a readable table (one row per turn) for MLflow's table view."""
    rows = []
    for r in records[:n]:
        for t in r.turns:
            rows.append({"rollout_id": r.rollout_id, "task_id": r.task.task_id, "turn": t.turn, "observation": t.observation,
                         "action": t.action, "reward": t.reward, "valid": t.valid, "won": t.won, "status": r.status})
    return pd.DataFrame(rows)
