"""Evaluation on the held-out split: sampled (success rate, pass@k) and greedy."""

from __future__ import annotations

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from horizonrl import faults
from horizonrl.config import TrainConfig
from horizonrl.rollout.loop import Shard
from horizonrl.rollout.metrics import TASK_COLUMNS, check_complete, episode_metrics, sample_episodes, task_outcomes
from horizonrl.rollout.records import EpisodeRecord
from horizonrl.run.player import Player
from horizonrl.seeding import derive_seed
from horizonrl.store import episodes_table, iteration_dir, read_table, turns_table, write_table
from horizonrl.tracking.mlflow_runs import log_table
from horizonrl.tracking.stats import paired_change
from horizonrl.training.checkpoint import CheckpointRef
from tasks.context import GENERATOR, PLAYER, RunContext
from tasks.tracking import log_stage, log_success_by_env_steps, logged, trace_evaluation


def evaluator(cfg: TrainConfig) -> Player:
    """Who plays the evaluation: the learner's player, or in an asynchronous vLLM run the generator, which
    owns the run's one server (the train flow lets the collects in flight end first, docs/algorithms.md §1.10)."""
    return GENERATOR if cfg.engine.name == "vllm" and cfg.rollout.max_staleness else PLAYER


def play(
    ctx: RunContext, policy: CheckpointRef, n_tasks: int, samples: int, greedy: bool, seed: int
) -> list[EpisodeRecord]:
    """The held-out episodes, every one played out: one the sampler failed (a vLLM server that died) fails
    the task before anything is stored or logged, and its retry syncs, restarting a dead server."""
    cfg = ctx.cfg
    p = evaluator(cfg)
    p.sync(cfg, policy)
    records = p.play(cfg, Shard(0, p.task_pool(cfg, cfg.eval.split, n_tasks), 0, 0, seed), samples, greedy)
    check_complete(records)
    return records


@task(name="evaluate", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def evaluate(
    ctx: RunContext, policy: CheckpointRef, iteration: int, end: bool = False, env_steps: int | None = None
) -> dict[str, float]:
    """Same held-out tasks at every evaluation (the first ``eval.n_tasks`` of the split, or
    ``eval.n_tasks_ends`` at the run's two ``end``s); sampling seeds fixed by (seed, iteration). Logs nothing
    until every figure is computed, so a retry logs once. ``env_steps``: the run's environment steps so far
    (the train flow's count); without it (the evaluate command, a warm start) no ``eval/success_by_env_steps``.
    At an ``end`` after iteration 0, the change from iteration 0 paired by task (``paired_figures``) too."""
    cfg = ctx.cfg
    n_tasks = cfg.eval.tasks_at(end)
    sampled = play(ctx, policy, n_tasks, cfg.eval.samples, False, derive_seed(cfg.seed, "eval", iteration))
    episodes = store_evaluation(ctx, iteration, policy, "eval", sampled)
    metrics = episode_metrics(episodes)
    metrics[f"pass_at_{cfg.eval.samples}"] = metrics.pop("pass_at_k")
    metrics.pop("mixed_group_fraction")
    if end and iteration > 0:
        metrics.update(paired_figures(ctx, episodes))
    if cfg.eval.greedy:
        greedy = play(ctx, policy, n_tasks, 1, True, derive_seed(cfg.seed, "eval-greedy", iteration))
        greedy_metrics = episode_metrics(store_evaluation(ctx, iteration, policy, "eval_greedy", greedy))
        metrics.update(
            {f"greedy_{k}": greedy_metrics[k] for k in ("success_rate", "mean_return", "mean_turns", "invalid_rate")}
        )
    faults.kill_point("evaluate", iteration)
    if not logged(ctx, "eval/success_rate", iteration):
        log_table(ctx.mlflow(), ctx.mlflow_run_id, sample_episodes(sampled), f"episodes/eval_iter_{iteration:05d}.json")
    trace_evaluation(ctx, iteration, sampled, policy.iteration)
    if env_steps is not None:
        log_success_by_env_steps(ctx, env_steps, metrics["success_rate"])
    log_stage(ctx, "eval", metrics, iteration)
    greedy_text = f" (greedy {metrics['greedy_success_rate']:.3f})" if "greedy_success_rate" in metrics else ""
    paired_text = (
        f"; paired change from iteration 0 {100 * metrics['paired_change']:+.1f} points "
        f"[{100 * metrics['paired_change_low']:+.1f}, {100 * metrics['paired_change_high']:+.1f}] on "
        f"{metrics['paired_tasks']:.0f} tasks"
        if "paired_change" in metrics
        else ""
    )
    get_run_logger().info(
        "iteration %d eval: success %.3f%s on %d held-out episodes%s",
        iteration,
        metrics["success_rate"],
        greedy_text,  # nothing for greedy decoding when it did not run (eval.greedy off)
        len(sampled),
        paired_text,  # nothing but at the run's last end
    )
    return metrics


def paired_figures(ctx: RunContext, episodes: pa.Table) -> dict[str, float]:
    """``paired_change`` (with ``_low``, ``_high``: its 95% interval) and ``paired_tasks``: the change of
    sampled success from iteration 0's evaluation (its stored ``eval-episodes.parquet``) to ``episodes``, this
    one's, over the held-out tasks both played (``stats.paired_change``). Nothing when iteration 0 stored no
    evaluation in this run's folder (the evaluate command's runs)."""
    cfg = ctx.cfg
    first = iteration_dir(cfg.data_dir, cfg.experiment, cfg.run_name, 0) / "eval-episodes.parquet"
    if not first.is_file():
        return {}
    before = task_outcomes(read_table(first, "episodes", TASK_COLUMNS))
    change, n = paired_change(before, task_outcomes(episodes))
    return {
        "paired_change": change.mean,
        "paired_change_low": change.low,
        "paired_change_high": change.high,
        "paired_tasks": float(n),
    }


def store_evaluation(
    ctx: RunContext, iteration: int, policy: CheckpointRef, kind: str, records: list[EpisodeRecord]
) -> pa.Table:
    """Write an evaluation's episodes and turns beside the iteration's training rollouts,
    ``iter=<n>/<kind>-episodes.parquet`` and ``<kind>-turns.parquet`` (``kind`` eval or eval_greedy, also
    the rows' ``kind``; ``family`` names the game, ``task_seed`` and ``sample_seed`` the seeds), so what
    was evaluated can be read back like the rollouts. Returns the episodes table as the figures read it.
    A retry or a resumed run rewrites the same files (fixed seeds)."""
    cfg = ctx.cfg
    table = episodes_table(records, cfg.run_name, iteration, policy.iteration)
    stored = table.set_column(
        table.schema.get_field_index("kind"), "kind", pa.array([kind] * table.num_rows, pa.string())
    )
    d = iteration_dir(cfg.data_dir, cfg.experiment, cfg.run_name, iteration)
    write_table(turns_table(records, policy.iteration), d / f"{kind}-turns.parquet", "turns")
    write_table(stored, d / f"{kind}-episodes.parquet", "episodes")
    return table  # the rows as played (kind initial), which the figures are computed over
