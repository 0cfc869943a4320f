"""The ``train`` flow: LOOP's iteration (docs/algorithms.md §1.8) written out, one task per stage.

    for each iteration:  1. collect -> 2. advantages -> 3. update (writes the checkpoint) -> 4. evaluate (every N)

With ``rollout.max_staleness`` = k >= 1 (docs/algorithms.md §1.10) step 1 takes rows that the generator
played ahead, beside the update of the iteration before, with its own copy of checkpoint max(i-k, 0)
(``async_mode: fixed``; ``bounded``: the newest one it finds, at least that one): ``tasks.collect.Collects``
submits the collects and logs the ``async/*`` figures of how stale the rows were and how long each side waited.

Running it again with the same ``run_name`` resumes after the last completed iteration, and evaluates on
the same schedule as an uninterrupted run (never at the iteration it resumes from), so a cell's numbers
do not depend on whether it was killed. One process at a time: a second one on a running run name is
refused, naming the holder (``horizonrl.run.runlock``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.warmstart import warmstart
from horizonrl import store
from horizonrl.config import TrainConfig, run_dir, train_config, warm_start_config
from horizonrl.run import preflight, runlock
from tasks.advantage import advantages
from tasks.collect import Collects
from tasks.context import open_owners
from tasks.evaluate import evaluate
from tasks.failures import one_line_failures
from tasks.run import clean_up_killed, end_failed_run, finish_run, open_run, start_afresh, starting_policy, verify_store
from tasks.tracking import Progress, log_iteration, log_startup, logged
from tasks.update import update

STARTED_AT = "HORIZONRL_STARTED_AT"  # set by `horizonrl train`: when its process started (Unix time)


@flow(name="train", log_prints=True, on_failure=[end_failed_run], on_crashed=[end_failed_run])
@one_line_failures  # a refused start (bad input, run in use, full disk): one line in the run's state, no traceback
def train(
    config_path: str | None = None,
    overrides: list[str] | None = None,
    config: dict[str, Any] | None = None,
    allow_change: list[str] | None = None,
) -> dict[str, float]:
    """Train one method on one environment; returns the summary figures (held-out success before/after).
    ``allow_change``: fields a resume may change beyond those that only extend the run (``--allow-change``)."""
    cfg = train_config(config_path, overrides, config)
    changes = preflight.check_start(cfg, allow_change or [])  # a deployment's run too: before its folder and run
    with runlock.hold(run_dir(cfg)) as lock:
        lock.record(flow_run_id=flow_run.get_id())
        start_afresh(cfg)  # a start that finished no iteration, run again with other settings, is no resume
        initial = None
        if cfg.warmstart.before_rl and not preflight.has_checkpoint(run_dir(cfg)):  # 0. the recipe's warm start
            ws = warmstart(config=warm_start_config(cfg).model_dump(), allow_change=allow_change, held_out=False)
            initial = ws["model_uri"]  # a finished warm start run again registers nothing new
        clean_up_killed(lock.previous)
        found = verify_store(cfg)
        open_owners(cfg)  # the learner, the player, the generator and the Ray cluster, until finish_run
        ctx = open_run(cfg, found, changes, initial)
        start = starting_policy(ctx, found, initial)
        policy, elapsed = start.policy, start.elapsed_s
        log_startup(ctx, os.environ.pop(STARTED_AT, None), policy.iteration)  # only `horizonrl train` sets it
        steps = store.env_steps(cfg.data_dir, cfg.experiment, cfg.run_name, range(1, policy.iteration + 1))
        if _eval_due(cfg, policy.iteration, elapsed, steps) and not logged(ctx, "eval/success_rate", policy.iteration):
            evaluate(
                ctx, policy, policy.iteration, _at_end(cfg, policy.iteration, elapsed, steps), steps
            )  # before training (or a missed one)
        progress, collects = Progress(ctx, policy.iteration), Collects(ctx)
        for it in range(policy.iteration + 1, cfg.iterations + 1):
            if _budget_spent(cfg, elapsed, steps):
                break
            t0 = time.perf_counter()
            rollouts = collects.take(it, policy)  # 1. rollouts of the current policy (asynchronous: at most k older)
            steps += store.env_steps(cfg.data_dir, cfg.experiment, cfg.run_name, range(it, it + 1))
            adv = advantages(ctx, it, rollouts, policy)  # 2. the method's advantages
            policy = update(ctx, it, rollouts, adv, policy, elapsed + time.perf_counter() - t0)  # 3. PPO -> checkpoint
            elapsed += time.perf_counter() - t0
            log_iteration(ctx, it, time.perf_counter() - t0, elapsed, steps)
            collects.done(it, rollouts, policy)
            progress.advance(it, rollouts.episodes)
            if _eval_due(cfg, it, elapsed, steps) and not logged(ctx, "eval/success_rate", it):
                collects.settle()
                evaluate(ctx, policy, it, _at_end(cfg, it, elapsed, steps), steps)  # 4. held-out evaluation
        progress.close()
        collects.close()
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
