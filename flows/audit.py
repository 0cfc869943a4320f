"""The ``audit`` flow: how well every advantage estimator tracks the Monte Carlo advantage of the very decisions
it scores, on one policy (docs/algorithms.md §8), in an MLflow run of its own:

    1. play groups of episodes as training collects them (and APPO's branches over them), stored as Parquet
    2. pick decision points at random, over early, middle and late turns and every task family
    3. estimate A_MC = Q(s_t, a_t) - V(s_t) at each from 2M continuations that replay the episode to s_t
    4. score every estimator of methods.ADVANTAGES on the same groups against it

Running it again with the same name resumes it: the groups, the points and every block of continuations
already stored are read, not played again. ``tasks.audit_settings.audit_settings`` checks everything the command
brings before the flow starts (the CLI calls it), so bad input is one line and no run is created.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from horizonrl.config import AuditConfig, TrainConfig
from horizonrl.run import runlock
from tasks.audit import (
    end_failed_audit,
    finish_audit,
    monte_carlo_truth,
    open_audit_player,
    pick_points,
    play_groups,
    start_audit,
)
from tasks.audit_scores import score_estimators
from tasks.context import close_owners


@flow(name="audit", log_prints=True, on_failure=[end_failed_audit], on_crashed=[end_failed_audit])
def audit(config: dict[str, Any], settings: dict[str, Any], name: str, policy: str | None = None) -> dict[str, Any]:
    """Audit ``policy`` (``audit_settings`` names the forms; None: the config's model) playing as ``config``
    says, with the audit's ``settings`` (``AuditConfig``), as the audit ``name``; returns its scores."""
    cfg = TrainConfig.model_validate(config)
    with runlock.hold(Path(cfg.data_dir) / cfg.experiment / name):  # one process per audit folder
        ref = start_audit(cfg, AuditConfig.model_validate(settings), policy, name)
        open_audit_player(ref)  # the audit's player, built for it as an evaluation's is, until it ends
        try:
            groups = play_groups(ref)  # 1. groups played as training collects them
            points = pick_points(ref, groups)  # 2. decision points, stratified
            points = monte_carlo_truth(ref, groups, points)  # 3. A_MC at each, from continuations
            scores = score_estimators(ref, groups, points)  # 4. every estimator against A_MC
            return finish_audit(ref, scores)
        finally:
            close_owners(ref.ctx.run_dir)
