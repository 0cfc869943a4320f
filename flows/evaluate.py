"""The ``evaluate`` flow: a logged policy, found by MLflow run id or registered model name and version,
evaluated on any split of its environment or, with ``--set env.games=...``, on other games, in a new
MLflow run tagged with the source run; or a model with no run behind it (``--model``: a model folder or a
pretrained model's name, played as a config file says: a prompted baseline), tagged with its lineage.

    1. plan: resolve the policy (download its checkpoint), the source run's config (its config.yaml
       artifact), eval settings and ``--set`` overrides applied, validated, split checked (before any run)
    2. open a new run (tags: source run or model lineage, policy URI), or continue a killed one's blocks
    3. evaluate (the train flow's task), with a player built for this evaluation
    4. the success rate's 95% Wilson interval; close the run (FAILED with the cause if a step failed)
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.context import close_owners, open_owners
from tasks.evaluate import evaluate
from tasks.evaluation_run import close_evaluation, fail_evaluation, open_evaluation, plan_evaluation


@flow(name="evaluate", log_prints=True)
def evaluate_policy(
    source: str | None = None,
    split: str = "test",
    n_tasks: int | None = None,
    samples: int | None = None,
    tracking_uri: str | None = None,
    overrides: list[str] | None = None,
    model: str | None = None,
    config_path: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``source`` (a run id, ``runs:/<run id>``, or ``models:/<name>/<version>``) on ``split``;
    returns the figures (with the success rate's 95% Wilson interval) and the new run's id. The environment,
    decoding and seed are the source run's, but for ``overrides`` (``--set``: ``EVAL_SETTABLE`` fields, e.g.
    ``env.games`` to score the policy on other games). Or, with ``model`` and ``config_path`` instead of
    ``source``, evaluate that model as the config says (``model_evaluation_config``), its run tagged with the
    model's lineage. Everything is checked before the run is created; a failure after marks it FAILED with
    the cause (tag ``horizonrl.failure``) and is raised."""
    plan = plan_evaluation(source, model, config_path, split, n_tasks, samples, overrides, tracking_uri)  # 1.
    ctx = open_evaluation(plan)  # 2.
    policy = plan.policy
    try:
        open_owners(ctx.cfg, evaluation=True)  # the player of this evaluation, until it ends
        # a finished policy: judged as a run's last evaluation; this run has no rollouts to count steps of
        metrics = evaluate(ctx, policy, policy.iteration, end=True)  # 3.
        metrics.update(close_evaluation(ctx, policy.iteration, metrics))  # 4.
    except BaseException as err:  # KeyboardInterrupt too: only a killed process leaves its run RUNNING
        fail_evaluation(ctx, err)
        raise
    finally:
        close_owners(ctx.run_dir)
    print(
        f"{plan.model_uri} on {split} ({ctx.cfg.eval.tasks_at(end=True)} tasks, {metrics['episodes']:.0f} episodes): "
        f"success {metrics['success_rate']:.3f} (95% interval {metrics['success_ci_low']:.3f} to "
        f"{metrics['success_ci_high']:.3f}); MLflow run {ctx.mlflow_run_id}"
    )
    return {"run_id": ctx.mlflow_run_id, "source_run_id": plan.source_run_id, **metrics}
