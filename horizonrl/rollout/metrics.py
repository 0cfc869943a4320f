"""Figures over an episodes table (success, return, turns, pass@k, ...), shared by the collect and evaluate
stages (same names, same meaning).

They are computed from the stored table (not from in-memory records) so that a resumed run can log the
figures of rollouts that were written before a crash.
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from horizonrl.rollout.records import ENGINE_FAULT, EpisodeRecord

FAMILY_SUCCESS = "success_rate/"  # then a task family: that family's success rate (logged under the stage's prefix)


def episode_metrics(episodes: pa.Table) -> dict[str, float]:
    """success_rate, mean_return, mean_turns, invalid_rate, tokens_per_episode, error_rate,
    mixed_group_fraction (groups whose returns are not all equal: the ones that carry signal), pass_at_k
    (share of groups with at least one win), episodes, and ``success_rate/<family>`` for each task family
    present (a suite mean hides which kinds of task a method learns). Over initial rollouts only (APPO
    branches are reported by the collect stage separately)."""
    df = episodes.select(
        ["group_id", "kind", "family", "n_turns", "episode_return", "won", "n_invalid", "gen_tokens", "status"]
    ).to_pandas()
    df = df[df["kind"] == "initial"]
    if df.empty:
        return {"episodes": 0.0}
    groups = df.groupby("group_id")
    by_family = df[df["family"] != ""].groupby("family")["won"].mean()
    return {
        "episodes": float(len(df)),
        "success_rate": float(df["won"].mean()),
        "mean_return": float(df["episode_return"].mean()),
        "mean_turns": float(df["n_turns"].mean()),
        "invalid_rate": float(df["n_invalid"].sum() / max(df["n_turns"].sum(), 1)),
        "tokens_per_episode": float(df["gen_tokens"].mean()),
        "error_rate": float((df["status"] == "error").mean()),
        "mixed_group_fraction": float((groups["episode_return"].nunique() > 1).mean()),
        "pass_at_k": float(groups["won"].any().mean()),
    } | {f"{FAMILY_SUCCESS}{family}": float(rate) for family, rate in by_family.items()}


TASK_COLUMNS = ["task_id", "task_seed", "won"]  # what ``task_outcomes`` reads of an episodes table


def task_outcomes(episodes: pa.Table) -> dict[str, list[float]]:
    """Each task's outcomes (1.0 won, 0.0 not), one per sampled episode, keyed ``<task_id>@<task_seed>``:
    the id names the task's place in its split and the seed what was built there, so two evaluations' keys
    match only where they played the same task."""
    out: dict[str, list[float]] = {}
    for task_id, seed, won in zip(*(episodes[name].to_pylist() for name in TASK_COLUMNS)):
        out.setdefault(f"{task_id}@{seed}", []).append(float(won))
    return out


class EvaluationIncomplete(RuntimeError):
    """Held-out episodes the sampler failed: a success rate over them would count its faults as the policy's."""


def check_complete(records: list[EpisodeRecord], what: str = "held-out episodes") -> None:
    """Refuse an evaluation (or the credit audit's episodes, ``what``) in which any episode was ended by the
    sampler (``ENGINE_FAULT``), naming how many and the first reason; an environment's own error stays the
    task's outcome, as in training."""
    failed = [r for r in records if r.status == "error" and r.error.startswith(ENGINE_FAULT)]
    if failed:
        raise EvaluationIncomplete(
            f"{len(failed)} of {len(records)} {what} were ended by the sampler, not played out "
            f"(first: {failed[0].error}); no figure is logged from them"
        )


def branch_metrics(episodes: pa.Table) -> dict[str, float]:
    """APPO: branch success, and the extra generation cost of branching as a share of all new tokens
    (a branch's first split + 1 action tokens are copied from its parent, not generated)."""
    df = episodes.select(["kind", "won", "gen_tokens", "branch_token"]).to_pandas()
    branch = df[df["kind"] == "branch"]
    new_branch = float((branch["gen_tokens"] - branch["branch_token"] - 1).sum())
    total = float(df.loc[df["kind"] == "initial", "gen_tokens"].sum()) + new_branch
    return {
        "branches": float(len(branch)),
        "branch_success_rate": float(branch["won"].mean()) if len(branch) else 0.0,
        "branch_token_share": new_branch / total if total else 0.0,
    }


def sample_episodes(episodes: pa.Table, turns: pa.Table, n: int = 8) -> pd.DataFrame:
    """The first ``n`` episodes of ``episodes`` as a readable table (one row per turn, from ``turns``) for
    MLflow's table view."""
    first = episodes.slice(0, n).select(["rollout_id", "task_id", "status"])
    mine = turns.filter(pc.is_in(turns["rollout_id"], value_set=first["rollout_id"].combine_chunks()))
    played = mine.select(["rollout_id", "turn", "observation", "action", "reward", "valid", "won"]).to_pandas()
    rows = first.to_pandas().merge(played, on="rollout_id", how="inner")
    columns = ["rollout_id", "task_id", "turn", "observation", "action", "reward", "valid", "won", "status"]
    return rows[columns].sort_values(["rollout_id", "turn"], kind="stable").reset_index(drop=True)
