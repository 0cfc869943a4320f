"""The ``train`` flow: LOOP's iteration (docs/algorithms.md §1.8) written out, one task per stage.

    for each iteration:  collect -> advantages -> update (writes the checkpoint) -> evaluate (every N)

Running it again with the same ``run_name`` resumes after the last completed iteration, and evaluates on
the same schedule as an uninterrupted run (never at the iteration it resumes from), so a cell's numbers
do not depend on whether it was killed. One process at a time: a second one on a running run name is
refused, naming the holder (``horizonrl.run.runlock``).
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from horizonrl import store
from horizonrl.config import TrainConfig, run_dir, train_config
from horizonrl.run import runlock
from tasks.advantage import advantages
from tasks.collect import collect_rollouts
from tasks.evaluate import evaluate
from tasks.run import end_failed_run, finish_run, start_run
from tasks.tracking import Progress, log_stage, logged
from tasks.update import update

STARTED_AT = "HORIZONRL_STARTED_AT"  # set by `horizonrl train`: when its process started (Unix time)


@flow(name="train", log_prints=True, on_failure=[end_failed_run], on_crashed=[end_failed_run])
def train(
    config_path: str | None = None, overrides: list[str] | None = None, config: dict[str, Any] | None = None
) -> dict[str, float]:
    """Train one method on one environment; returns the summary figures (held-out success before/after)."""
    cfg = train_config(config_path, overrides, config)
    with runlock.hold(run_dir(cfg)) as lock:
        lock.record(flow_run_id=flow_run.get_id())
        run = start_run(cfg, lock.previous)
        ctx, policy, elapsed = run.ctx, run.policy, run.elapsed_s
        started = os.environ.pop(STARTED_AT, None)  # set by `horizonrl train`: absent for sweep cells and deployments
        if started is not None:  # process start -> the first stage: imports, Prefect's API server, opening the run
            log_stage(ctx, "time", {"startup_s": time.time() - float(started)}, policy.iteration)
        steps = store.env_steps(cfg.data_dir, cfg.experiment, cfg.run_name, range(1, policy.iteration + 1))
        if _eval_due(cfg, policy.iteration, elapsed, steps) and not logged(ctx, "eval/success_rate", policy.iteration):
            evaluate(
                ctx, policy, policy.iteration, _at_end(cfg, policy.iteration, elapsed, steps), steps
            )  # before training (or a missed one)
        progress = Progress(ctx, policy.iteration)
        for it in range(policy.iteration + 1, cfg.iterations + 1):
            if _budget_spent(cfg, elapsed, steps):
                break
            t0 = time.perf_counter()
            rollouts = collect_rollouts(ctx, it, policy)  # 1. rollouts of the current policy
            steps += store.env_steps(cfg.data_dir, cfg.experiment, cfg.run_name, range(it, it + 1))
            adv = advantages(ctx, it, rollouts, policy)  # 2. the method's advantages
            policy = update(ctx, it, rollouts, adv, policy, elapsed + time.perf_counter() - t0)  # 3. PPO -> checkpoint
            elapsed += time.perf_counter() - t0
            log_stage(
                ctx, "time", {"iteration_s": time.perf_counter() - t0, "train_s": elapsed, "env_steps": steps}, it
            )
            log_stage(ctx, "system", {"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, it)
            progress.advance(it, rollouts.episodes)
            if _eval_due(cfg, it, elapsed, steps) and not logged(ctx, "eval/success_rate", it):
                evaluate(ctx, policy, it, _at_end(cfg, it, elapsed, steps), steps)  # 4. held-out evaluation
        progress.close()
        return finish_run(ctx, policy)


def _eval_due(cfg: TrainConfig, iteration: int, elapsed_s: float, env_steps: int) -> bool:
    """The evaluation schedule: before training, every ``eval.every`` iterations, and after the last one."""
    return iteration % cfg.eval.every == 0 or _at_end(cfg, iteration, elapsed_s, env_steps)


def _at_end(cfg: TrainConfig, iteration: int, elapsed_s: float, env_steps: int) -> bool:
    """Before training, or after the last iteration (the configured number, or the one that spent the
    budget): the evaluations a run's gain is read from (``eval.n_tasks_ends``)."""
    return iteration == 0 or iteration >= cfg.iterations or _budget_spent(cfg, elapsed_s, env_steps)


def _budget_spent(cfg: TrainConfig, elapsed_s: float, env_steps: int) -> bool:
    """The run's training wall time or environment steps have reached their budget (if it has one)."""
    return (cfg.time_budget_s is not None and elapsed_s >= cfg.time_budget_s) or (
        cfg.env_step_budget is not None and env_steps >= cfg.env_step_budget
    )
