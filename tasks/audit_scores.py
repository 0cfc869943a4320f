"""Step 4 of the credit audit (docs/algorithms.md §8.1, §8.4): every estimator of ``methods.ADVANTAGES`` over the
audit's groups, computed as training computes it, each decision point's per-turn value, and the statistics
(``horizonrl.audit.scores``) into the audit's ``scores.json``."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
from prefect import task
from prefect.cache_policies import NONE

import methods
from horizonrl import store
from horizonrl.audit import points as audit_points
from horizonrl.audit import scores
from horizonrl.audit.page import SCORES_FILE
from horizonrl.audit.policy import stored_batches
from horizonrl.config import TrainConfig
from horizonrl.files import write_json
from horizonrl.seeding import derive_seed
from methods.presets import METHODS
from tasks.advantage import compute_advantages
from tasks.audit import AuditRef, GroupsRef
from tasks.collect import RolloutRef


def estimator_specs(cfg: TrainConfig) -> dict[str, object]:
    """Every estimator of ``methods.ADVANTAGES`` with its params as a run of its method would have them: the
    preset, ``per_method.<method>``, and for the config's own method its top-level ``advantage_params``; an
    estimator no method names, with its defaults."""
    specs = {}
    for method, preset in METHODS.items():
        one = cfg if method == cfg.method else cfg.model_copy(update={"method": method, "advantage_params": {}})
        specs[preset.advantage] = one.advantage_spec()[1]
    for name in methods.ADVANTAGES.names():
        specs.setdefault(name, methods.ADVANTAGES.get(name).params_cls())
    return specs


def _states(ref: AuditRef, name: str, params: object) -> list[tuple[str, dict | None]]:
    """(label, state) to score estimator ``name`` with: a stateless one once; a stateful one (BLPO) cold, and
    warm from the batches the policy's training run stored up to its checkpoint (as ``recompute`` chains it)."""
    if methods.ADVANTAGES.get(name).load_state is None:
        return [(name, None)]
    out = [(f"{name}_cold", None)]
    if ref.trained_by is not None:
        state = None
        for d in stored_batches(ref.trained_by, ref.policy.iteration):
            episodes = store.read_table(d / "episodes.parquet", "episodes", columns=["policy_version"])
            version = int(episodes["policy_version"][0].as_py()) if episodes.num_rows else 0
            rollouts = RolloutRef(-1, str(d / "episodes.parquet"), str(d / "turns.parquet"))
            _, state, _ = compute_advantages(rollouts, name, params, state, version)
        out.append((f"{name}_warm", state))
    return out


@task(name="audit-score", cache_policy=NONE)
def score_estimators(ref: AuditRef, groups: GroupsRef, points_path: str) -> str:
    """Step 4: every estimator's per-turn value at each point (``estimator_columns``), the statistics
    (``horizonrl.audit.scores``) into ``scores.json``, and the per-point table as an MLflow artifact."""
    points = estimator_columns(ref, groups, store.read_table(points_path, "audit").to_pandas())
    labels = [c for c in points.columns if c not in store.AUDIT.names]
    seed = derive_seed(ref.ctx.cfg.seed, "audit", "bootstrap")
    result = scores.score(points, labels, ref.audit.bootstrap, seed, ref.audit.sign_z)
    with tempfile.TemporaryDirectory() as tmp:  # the per-point table, every estimator's column beside A_MC
        table = Path(tmp) / "points.parquet"
        points.drop(columns=["q_returns", "v_returns"]).to_parquet(table, index=False)
        ref.ctx.mlflow().log_artifact(ref.ctx.mlflow_run_id, str(table), "audit")
    write_json(_summary(ref, result, labels), Path(ref.path(SCORES_FILE)))
    return ref.path(SCORES_FILE)


def estimator_columns(ref: AuditRef, groups: GroupsRef, points: pd.DataFrame) -> pd.DataFrame:
    """``points`` with one column per estimator label: its advantage of each point's turn, computed as training
    computes it (``tasks.advantage.compute_advantages`` over the stored groups; APPO over the groups and its
    branches) and stored as ``advantages-<label>.parquet``; and ``appo_at_branches``, APPO's value where the
    turn holds one of its own branch points (NaN elsewhere)."""
    for name, params in estimator_specs(ref.ctx.cfg).items():
        paths = (groups.appo_episodes, groups.appo_turns) if name == "appo" else (groups.episodes, groups.turns)
        for label, state in _states(ref, name, params):
            table, after, _ = compute_advantages(RolloutRef(-1, *paths), name, params, state, ref.policy.iteration)
            store.write_advantages(ref.ctx.path, label, table, after)
            adv = table.select(["rollout_id", "turn", "adv"]).to_pandas().rename(columns={"adv": label})
            points = points.merge(adv, on=["rollout_id", "turn"], how="left")
    at_branch = audit_points.branch_turns(*groups.tables(appo=True))
    here = [(r, t) in at_branch for r, t in zip(points["rollout_id"], points["turn"])]
    return points.assign(appo_at_branches=points["appo"].where(here))


def _summary(ref: AuditRef, result: dict, labels: list[str]) -> dict:
    """``scores.json``: what the page reads (the audit's settings, its figures, its cost), plain JSON."""
    cfg, r = ref.ctx.cfg, ref.ctx.cfg.rollout
    measured = ref.ctx.mlflow().get_run(ref.ctx.mlflow_run_id).data.metrics
    return {
        "name": cfg.run_name,
        "policy": ref.source,
        "policy_path": ref.policy.path,
        "policy_iteration": ref.policy.iteration,
        "trained_by": ref.trained_by,
        "config": {"env": cfg.env.name, "tier": cfg.env.tier, "group_size": r.group_size, "context": r.context,
                   "prompt": r.prompt, "action_mode": r.action_mode, "engine": cfg.engine.name, "seed": cfg.seed},
        "audit": ref.audit.model_dump(),
        "points": result["points"],
        "points_nonzero": result["points_nonzero"],
        "noise_ceiling": result["noise_ceiling"].as_dict(),
        "max_correlation": result["max_correlation"],
        "order": labels,
        "estimators": {k: {m: e.as_dict() for m, e in v.items()} for k, v in result["estimators"].items()},
        "pairs": [{**p, "difference": p["difference"].as_dict()} for p in result["pairs"]],
        "seconds_per_point": measured.get("audit/seconds_per_point"),
        "seconds": {k.removeprefix("time/"): v for k, v in measured.items() if k.startswith("time/")},
    }  # fmt: skip
