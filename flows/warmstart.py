"""The ``warmstart`` flow: behaviour cloning on the suite's walkthroughs, so RL starts from a policy that
already does something (a model trained from scratch on a 30-50 turn task starts near 1% success).

    demonstrations (walkthroughs of training tasks, Parquet) -> evaluate the initial policy
    -> for each epoch: clone (cross-entropy on action tokens) -> evaluate (every ``eval.every``)
    -> log the policy as an MLflow model -> register it (``warmstart.model_name``)

A train config then starts from it with ``model.path: models:/<name>/<version>``. Running it again with
the same ``run_name`` resumes after the last finished epoch and registers nothing new.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from horizonrl.config import run_dir, train_config
from horizonrl.run import preflight, runlock
from tasks.context import open_owners
from tasks.evaluate import evaluate
from tasks.failures import one_line_failures
from tasks.run import clean_up_killed, end_failed_run, finish_run, open_run, start_afresh, starting_policy, verify_store
from tasks.tracking import logged
from tasks.warmstart import clone, log_losses, record_demonstrations, register_warm_start


@flow(name="warmstart", log_prints=True, on_failure=[end_failed_run], on_crashed=[end_failed_run])
@one_line_failures  # a refused start: one line in the run's state, no traceback
def warmstart(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    config: dict[str, Any] | None = None,
    allow_change: list[str] | None = None,
    held_out: bool = True,
) -> dict[str, Any]:
    """Clone the walkthroughs; returns the summary (held-out success before and after) and the registered
    model's URI under ``model_uri``. ``allow_change``: as for ``train``. ``held_out`` off evaluates nothing:
    the warm start of a train run's recipe (``warmstart.before_rl``), whose RL run evaluates its policy."""
    cfg = train_config(config_path, overrides, config)
    changes = preflight.check_start(cfg, allow_change or [], length="warmstart.epochs")
    with runlock.hold(run_dir(cfg)) as lock:  # one process per run name, as for train
        lock.record(flow_run_id=flow_run.get_id())
        start_afresh(cfg)  # a start that finished no epoch, run again with other settings, is no resume
        clean_up_killed(lock.previous)
        found = verify_store(cfg)
        open_owners(cfg)  # the learner and its player, until finish_run
        ctx = open_run(cfg, found, changes, kind="warmstart")
        policy = starting_policy(ctx, found).policy
        log_losses(ctx, policy)  # a resumed run whose last epoch crashed before its log
        demos = record_demonstrations(ctx, policy)  # 1. walkthroughs as Parquet
        if held_out and not logged(ctx, "eval/success_rate", 0):
            evaluate(ctx, policy, 0)  # the starting point (a warm start has no rollouts)
        done, last = policy.iteration, cfg.warmstart.epochs
        due = held_out and done and (done % cfg.eval.every == 0 or done == last)
        if due and not logged(ctx, "eval/success_rate", done):
            evaluate(ctx, policy, done, end=done == last)  # a run killed in the evaluation after its last epoch
        for epoch in range(policy.iteration + 1, cfg.warmstart.epochs + 1):
            policy = clone(ctx, epoch, demos, policy)  # 2. cross-entropy on action tokens
            if held_out and (epoch % cfg.eval.every == 0 or epoch == cfg.warmstart.epochs):
                evaluate(ctx, policy, epoch, end=epoch == cfg.warmstart.epochs)  # 3. held-out
        summary: dict[str, Any] = dict(finish_run(ctx, policy))  # 4. logged as an MLflow model
    summary["model_uri"] = register_warm_start(ctx)  # 5. registered: a train run starts from it
    print(
        f"warm start registered as {summary['model_uri']} (run {ctx.mlflow_run_id}); start RL from it with --set "
        f"model.path={summary['model_uri']}"
    )
    return summary
