"""The ``train`` flow: LOOP's iteration (docs/algorithms.md §1.8) written out, one task per stage.

    for each iteration:  collect -> advantages -> update (writes the checkpoint) -> evaluate (every N)

With ``rollout.max_staleness`` = k >= 1 (docs/algorithms.md §1.10) the collect task of iteration i+1 is
submitted (a Prefect task future) before the update of iteration i, so the generator plays it beside that
update with its own copy of checkpoint max(i-k, 0) (``async_mode: fixed``; ``bounded``: the newest one it
finds, at least that one). Each stage logs at its own iteration; ``async/*`` figures say how stale the
rows were and how long each side waited.

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
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run

from flows.warmstart import warmstart
from horizonrl import store
from horizonrl.config import TrainConfig, run_dir, train_config, warm_start_config
from horizonrl.run import preflight, runlock
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointRef, checkpoint_dir
from tasks.advantage import advantages
from tasks.collect import RolloutRef, collect_rollouts
from tasks.context import CLUSTER, GENERATOR, RunContext
from tasks.evaluate import evaluate
from tasks.run import end_failed_run, finish_run, one_line_failures, start_afresh, start_run
from tasks.tracking import Progress, log_stage, logged
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
        run = start_run(cfg, lock.previous, changes, initial)
        ctx, policy, elapsed = run.ctx, run.policy, run.elapsed_s
        CLUSTER.join(cfg)  # a run on Ray: left by finish_run (or the failure hook)
        started = os.environ.pop(STARTED_AT, None)  # set by `horizonrl train`: absent for sweep cells and deployments
        if started is not None:  # process start -> the first stage: imports, Prefect's API server, opening the run
            log_stage(ctx, "time", {"startup_s": time.time() - float(started)}, policy.iteration)
        steps = store.env_steps(cfg.data_dir, cfg.experiment, cfg.run_name, range(1, policy.iteration + 1))
        if _eval_due(cfg, policy.iteration, elapsed, steps) and not logged(ctx, "eval/success_rate", policy.iteration):
            evaluate(
                ctx, policy, policy.iteration, _at_end(cfg, policy.iteration, elapsed, steps), steps
            )  # before training (or a missed one)
        progress = Progress(ctx, policy.iteration)
        ahead = AsyncCollect(ctx) if cfg.rollout.max_staleness else None
        for it in range(policy.iteration + 1, cfg.iterations + 1):
            if _budget_spent(cfg, elapsed, steps):
                break
            t0 = time.perf_counter()
            if ahead is None:
                rollouts = collect_rollouts(ctx, it, policy)  # 1. rollouts of the current policy
            else:
                rollouts = ahead.take(it, policy)  # 1. rollouts of a policy at most k versions older
            steps += store.env_steps(cfg.data_dir, cfg.experiment, cfg.run_name, range(it, it + 1))
            adv = advantages(ctx, it, rollouts, policy)  # 2. the method's advantages
            policy = update(ctx, it, rollouts, adv, policy, elapsed + time.perf_counter() - t0)  # 3. PPO -> checkpoint
            elapsed += time.perf_counter() - t0
            log_stage(
                ctx, "time", {"iteration_s": time.perf_counter() - t0, "train_s": elapsed, "env_steps": steps}, it
            )
            log_stage(ctx, "system", {"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, it)
            if ahead is not None:
                ahead.done(it, rollouts, policy)
            progress.advance(it, rollouts.episodes)
            if _eval_due(cfg, it, elapsed, steps) and not logged(ctx, "eval/success_rate", it):
                if ahead is not None:
                    ahead.settle()
                evaluate(ctx, policy, it, _at_end(cfg, it, elapsed, steps), steps)  # 4. held-out evaluation
        progress.close()
        if ahead is not None:
            ahead.close()
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


class AsyncCollect:
    """The generator's side of asynchronous rollouts (``rollout.max_staleness`` = k >= 1, docs/algorithms.md
    §1.10): collect tasks submitted ahead of the update, one after another (each waits for the one before:
    the generator holds one model), iteration j played by checkpoint max(j-1-k, 0), so the schedule is
    fixed by k alone and a resumed run plays what an uninterrupted one does (``bounded``: that checkpoint or
    a newer one, whichever is newest when the task starts). With vLLM the generator is the run's server,
    synced at the start of each collect, before its first episode: no episode straddles two versions."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx, self.k = ctx, ctx.cfg.rollout.max_staleness
        self.newest = ctx.cfg.rollout.async_mode == "bounded"
        self.futures: dict[int, PrefectFuture] = {}
        self.played: list[tuple[float, float]] = []  # wall-clock (start, end) of every collect played here
        self.windows: dict[int, tuple[float, float, float]] = {}  # iteration -> (start, end, learner wait s)
        if self.newest:
            mlflow_runs.set_tags(
                ctx.mlflow(),
                ctx.mlflow_run_id,
                {"async_mode": "bounded", "reproducible": "false: the generator plays whichever checkpoint is newest"},
            )

    def take(self, iteration: int, policy: CheckpointRef) -> RolloutRef:
        """Submit every collect the bound allows now (up to iteration + k), then wait for this iteration's."""
        started = time.time()
        last = min(policy.iteration + 1 + self.k, self.ctx.cfg.iterations)
        for j in range(iteration, last + 1):
            if j not in self.futures:
                version = max(j - 1 - self.k, 0)
                ref = CheckpointRef(str(checkpoint_dir(self.ctx.path, version)), version)
                before = [self.futures[j - 1]] if j - 1 in self.futures else []
                self.futures[j] = collect_rollouts.submit(self.ctx, j, ref, self.newest, wait_for=before)
        rollouts = self.futures[iteration].result()
        if rollouts.played is not None:
            self.played.append(rollouts.played)
        self.windows[iteration] = (started, 0.0, time.time() - started)
        return rollouts

    def done(self, iteration: int, rollouts: RolloutRef, policy: CheckpointRef) -> None:
        """Log the iteration's ``async/*`` figures: staleness of its rows against the checkpoint its update
        started from, the learner's waiting share, batches played and not yet used; and the generator's idle
        share of the iteration before (its collects overlapping that one have ended by now)."""
        start, _, wait = self.windows[iteration]
        end = time.time()
        self.windows[iteration] = (start, end, wait)
        stale = float(policy.iteration - 1 - rollouts.policy_version)
        queued = sum(f.state.is_completed() for j, f in self.futures.items() if j > iteration)
        figures = {
            "staleness_mean": stale,
            "staleness_max": stale,
            "learner_idle_fraction": wait / max(end - start, 1e-9),
            "queued_batches": float(queued),
        }
        log_stage(self.ctx, "async", figures, iteration)
        self.futures.pop(iteration, None)
        if iteration - 1 in self.windows:
            self._log_generator_idle(iteration - 1)

    def _log_generator_idle(self, iteration: int) -> None:
        """The share of iteration ``iteration``'s wall time the generator was not playing."""
        start, end, _ = self.windows.pop(iteration)
        busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.played)
        log_stage(self.ctx, "async", {"generator_idle_fraction": 1.0 - busy / max(end - start, 1e-9)}, iteration)

    def settle(self) -> None:
        """Before an evaluation of a vLLM run: let the collects in flight end, so that the run's one server
        plays one version at a time (the evaluation syncs it to the evaluated checkpoint, the next collect
        back to its own). The transformers generator has its own weights: nothing to wait for."""
        if self.ctx.cfg.engine.name == "vllm":
            for f in self.futures.values():
                f.wait()

    def close(self) -> None:
        """Wait for collects still playing (a budget stopped the run early), log the last iteration's
        generator figure and free the generator's copy of the weights and its environments."""
        for f in self.futures.values():
            f.wait()
        for it in sorted(self.windows):
            if self.windows[it][1]:
                self._log_generator_idle(it)
        GENERATOR.close_episodes()
        GENERATOR.weights.drop()
