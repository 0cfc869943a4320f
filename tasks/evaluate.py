"""Evaluation on the held-out split: sampled (success rate, pass@k) and greedy."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from horizonrl import faults, shared_eval
from horizonrl.config import TrainConfig
from horizonrl.rollout.loop import Shard, split_shards
from horizonrl.rollout.metrics import TASK_COLUMNS, check_complete, episode_metrics, sample_episodes, task_outcomes
from horizonrl.seeding import derive_seed
from horizonrl.store import StoreError, episodes_table, iteration_dir, read_table, turns_table, write_table
from horizonrl.tracking.mlflow_runs import log_table
from horizonrl.tracking.stats import paired_change
from horizonrl.training.checkpoint import CheckpointRef, policy_digest
from tasks.context import RunContext, owners
from tasks.tracking import log_stage, log_success_by_env_steps, logged, set_run_tags, trace_evaluation


@dataclass(frozen=True)
class Plays:
    """What one evaluation plays: its kind (``eval``, ``eval_greedy``: the stored files' prefix), the first
    ``n_tasks`` held-out tasks, ``samples`` episodes each, greedy or sampled, with sampling seeds from ``seed``."""

    kind: str
    n_tasks: int
    samples: int
    greedy: bool
    seed: int


def play(ctx: RunContext, policy: CheckpointRef, iteration: int, what: Plays) -> tuple[pa.Table, pa.Table]:
    """The held-out episodes and turns as played (rows of kind ``initial``), every episode played out: one the
    sampler failed (a vLLM server that died) fails the task before its block is stored, and the retry syncs,
    restarting a dead server. Played in ``eval.block_tasks`` blocks (``split_shards``: rollout and group ids
    as one batch numbers them); with more than one, each finished block is stored
    (``<kind>-block-<b>-of-<n>-*.parquet`` in the iteration's folder) and a block stored by an earlier try of
    this very evaluation (same checkpoint, tasks and sampling seeds) is read instead of played again."""
    cfg, kind, samples = ctx.cfg, what.kind, what.samples
    p = owners(ctx).evaluator  # in an asynchronous vLLM run the generator: it owns the run's one server
    tasks = p.task_pool(cfg.eval.split, what.n_tasks)
    n_blocks = math.ceil(len(tasks) / cfg.eval.block_tasks) if cfg.eval.block_tasks else 1
    d = iteration_dir(cfg.data_dir, cfg.experiment, cfg.run_name, iteration)
    synced, episodes, turns = False, [], []
    for shard in split_shards(tasks, n_blocks, samples, what.seed):
        paths = [d / f"{kind}-block-{shard.index:04d}-of-{n_blocks:04d}-{t}.parquet" for t in ("turns", "episodes")]
        stored = _stored_block(paths, shard, samples, policy.iteration) if n_blocks > 1 else None
        if stored is None:
            if not synced:
                p.sync(policy)
                synced = True
            records = p.play(shard, what.greedy)
            check_complete(records)
            stored = (
                turns_table(records, policy.iteration),
                episodes_table(records, cfg.run_name, iteration, policy.iteration),
            )
            if n_blocks > 1:  # turns first: the episodes file marks the block complete
                for table, path, name in zip(stored, paths, ("turns", "episodes")):
                    write_table(table, path, name)
                faults.kill_point("eval-block", shard.index)
        else:
            get_run_logger().info("%s block %d of %d: read as an earlier try stored it", kind, shard.index, n_blocks)
        turns.append(stored[0])
        episodes.append(stored[1])
    return pa.concat_tables(episodes), pa.concat_tables(turns)


def played(ctx: RunContext, policy: CheckpointRef, iteration: int, what: Plays) -> tuple[pa.Table, pa.Table]:
    """``play``, except at iteration 0: a starting evaluation another run played with the same
    policy and settings (``horizonrl.shared_eval``: a shared warm start's every method) is read instead of
    played, and one played here is stored for the next run (tag ``horizonrl.eval0.<kind>.played_by``)."""
    if iteration != 0:
        return play(ctx, policy, iteration, what)
    digest = policy_digest(policy)
    cfg, kind = ctx.cfg, what.kind
    folder = shared_eval.shared_dir(cfg.data_dir, cfg.experiment, digest, starting_eval_settings(cfg))
    found = shared_eval.read_shared(folder, kind)
    if found is None:
        episodes, turns = play(ctx, policy, iteration, what)
        played_by = {"run_name": cfg.run_name, "mlflow_run_id": ctx.mlflow_run_id}
        shared_eval.publish(folder, kind, episodes, turns, played_by)
    else:
        episodes, turns, played_by = found
        get_run_logger().info(
            "iteration 0 %s: read as run %s played it (the same policy and settings)", kind, played_by["run_name"]
        )
    set_run_tags(ctx, {f"horizonrl.eval0.{kind}.played_by": played_by["run_name"]})
    return episodes, turns


def starting_eval_settings(cfg: TrainConfig) -> dict[str, object]:
    """What decides the episodes of a run's starting evaluation besides its policy: the seed (its sampling
    seeds) and the sections of the environment, the model's numerics, the rollout, the engine and the
    evaluation. The rollout's batch sizes are in it too: shared needlessly, they only share less."""
    sections = ("env", "model", "rollout", "eval", "engine")
    return {"seed": cfg.seed, **{name: getattr(cfg, name).model_dump(mode="json") for name in sections}}


def _stored_block(paths: list[Path], shard: Shard, samples: int, version: int) -> tuple[pa.Table, pa.Table] | None:
    """A block's (turns, episodes) stored by an earlier try, if both files read and hold exactly the episodes
    this block plays: its rollout ids, tasks and sampling seeds, by checkpoint ``version``. Anything else
    (a file cut short, another checkpoint's) is played again and overwritten."""
    if not all(path.is_file() for path in paths):
        return None
    try:
        episodes = read_table(paths[1], "episodes")
    except StoreError:
        return None
    ids = [shard.first_rollout_id + slot for slot in range(len(shard.tasks) * samples)]
    want = {
        "rollout_id": ids,
        "task_id": [t.task_id for t in shard.tasks for _ in range(samples)],
        "task_seed": [t.seed for t in shard.tasks for _ in range(samples)],
        "sample_seed": [derive_seed(shard.seed, "sample", rid) for rid in ids],
        "policy_version": [version] * len(ids),
    }
    if any(episodes[name].to_pylist() != values for name, values in want.items()):
        return None
    try:  # read only once the episodes say the block is this one
        return read_table(paths[0], "turns"), episodes
    except StoreError:
        return None


def block_files(d: Path, kind: str) -> list[Path]:
    """The stored blocks of ``kind`` evaluations (a glob pattern: ``eval*`` for both kinds) in folder ``d``."""
    return sorted(d.glob(f"{kind}-block-*.parquet"))


@task(name="evaluate", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def evaluate(
    ctx: RunContext, policy: CheckpointRef, iteration: int, end: bool = False, env_steps: int | None = None
) -> dict[str, float]:
    """Same held-out tasks at every evaluation (the first ``eval.n_tasks`` of the split, or
    ``eval.n_tasks_ends`` at the run's two ``end``s); sampling seeds fixed by (seed, iteration). Logs nothing
    until every figure is computed, so a retry logs once. ``env_steps``: the run's environment steps so far
    (the train flow's count); without it (the evaluate command, a warm start) no ``eval/success_by_env_steps``.
    At an ``end`` after iteration 0, the change from iteration 0 paired by task (``paired_figures``) too; and
    ``time/eval_s``, the wall seconds of the try that finished it."""
    t0 = time.perf_counter()
    cfg = ctx.cfg
    n_tasks = cfg.eval.tasks_at(end)
    seed = derive_seed(cfg.seed, "eval", iteration)
    episodes, turns = played(ctx, policy, iteration, Plays("eval", n_tasks, cfg.eval.samples, False, seed))
    metrics = episode_metrics(episodes)
    metrics[f"pass_at_{cfg.eval.samples}"] = metrics.pop("pass_at_k")
    metrics.pop("mixed_group_fraction")
    if end and iteration > 0:
        metrics.update(paired_figures(ctx, episodes))
    greedy = None
    if cfg.eval.greedy:
        seed = derive_seed(cfg.seed, "eval-greedy", iteration)
        greedy = played(ctx, policy, iteration, Plays("eval_greedy", n_tasks, 1, True, seed))
        greedy_metrics = episode_metrics(greedy[0])
        metrics.update({f"greedy_{k}": greedy_metrics[k] for k in GREEDY_FIGURES})
    store_evaluation(ctx, iteration, "eval", episodes, turns)
    if greedy is not None:
        store_evaluation(ctx, iteration, "eval_greedy", *greedy)
    faults.kill_point("evaluate", iteration)
    _log_evaluation(ctx, iteration, episodes, turns, metrics, env_steps)
    log_stage(
        ctx, "time", {"eval_s": time.perf_counter() - t0}, iteration
    )  # this try's; with the iterations', a run's cost
    return metrics


GREEDY_FIGURES = ("success_rate", "mean_return", "mean_turns", "invalid_rate")
"""The figures of greedy decoding logged beside the sampled ones, as ``eval/greedy_<name>``."""


def _log_evaluation(
    ctx: RunContext,
    iteration: int,
    episodes: pa.Table,
    turns: pa.Table,
    metrics: dict[str, float],
    env_steps: int | None,
) -> None:
    """An evaluation's sample table, traces and ``eval/*`` figures, and its log line."""
    if not logged(ctx, "eval/success_rate", iteration):
        table = sample_episodes(episodes, turns)
        log_table(ctx.mlflow(), ctx.mlflow_run_id, table, f"episodes/eval_iter_{iteration:05d}.json")
    trace_evaluation(ctx, iteration, episodes, turns)
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
        episodes.num_rows,
        paired_text,  # nothing but at the run's last end
    )


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


def store_evaluation(ctx: RunContext, iteration: int, kind: str, episodes: pa.Table, turns: pa.Table) -> None:
    """Write an evaluation's episodes and turns beside the iteration's training rollouts,
    ``iter=<n>/<kind>-episodes.parquet`` and ``<kind>-turns.parquet`` (``kind`` eval or eval_greedy, also
    the rows' ``kind``; ``family`` names the game, ``task_seed`` and ``sample_seed`` the seeds), so what
    was evaluated can be read back like the rollouts; then remove its blocks, if it was played in blocks.
    A retry or a resumed run rewrites the same files (fixed seeds)."""
    cfg = ctx.cfg
    stored = episodes.set_column(
        episodes.schema.get_field_index("kind"), "kind", pa.array([kind] * episodes.num_rows, pa.string())
    )
    d = iteration_dir(cfg.data_dir, cfg.experiment, cfg.run_name, iteration)
    write_table(turns, d / f"{kind}-turns.parquet", "turns")
    write_table(stored, d / f"{kind}-episodes.parquet", "episodes")
    for block in block_files(d, kind):
        block.unlink()
