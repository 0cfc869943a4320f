"""Stage 1: play the iteration's rollouts with the current policy and store them as Parquet."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from horizonrl import store
from horizonrl.checkpoint import CheckpointRef
from horizonrl.evaluation import episode_metrics, mixed_group_fraction
from horizonrl.rollout import collect
from horizonrl.runtime import sample_tasks
from horizonrl.seeding import derive_seed
from tasks.context import RUNTIME, RunContext
from tasks.tracking import log_stage


@dataclass(frozen=True)
class RolloutRef:
    iteration: int
    episodes: str  # path of episodes.parquet
    turns: str  # path of turns.parquet


@task(name="collect", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def collect_rollouts(ctx: RunContext, iteration: int, policy: CheckpointRef) -> RolloutRef:
    """Rollout tables are immutable: if this iteration's are complete (after a crash), reuse them.

    No Prefect cache: completeness is read from the store itself (episodes.parquet is written last).
    """
    cfg = ctx.cfg
    d = store.iteration_dir(cfg.data_dir, cfg.experiment, cfg.run_name, iteration)
    ref = RolloutRef(iteration, str(d / "episodes.parquet"), str(d / "turns.parquet"))
    if (d / "episodes.parquet").is_file() and (d / "turns.parquet").is_file():
        get_run_logger().info("iteration %d: rollouts already stored, reused", iteration)
        return ref
    loaded = RUNTIME.get(cfg, policy)
    suite = RUNTIME.suite(cfg)
    pool = RUNTIME.task_pool(cfg, "train", cfg.env.train_pool)
    r = cfg.rollout
    records = collect(
        suite, sample_tasks(pool, r.tasks_per_iteration, cfg.seed, iteration), r.group_size, loaded.engine, loaded.fmt,
        action_mode=r.action_mode, context=r.context, history_turns=r.history_turns,
        max_turns=cfg.env.max_turns or suite.max_turns(cfg.env.tier), max_action_tokens=r.max_action_tokens,
        temperature=r.temperature, seed=derive_seed(cfg.seed, "collect", iteration),
    )
    turns_digest = store.write_table(store.turns_table(records), ref.turns, "turns")
    episodes_digest = store.write_table(store.episodes_table(records, cfg.run_name, iteration, policy.iteration), ref.episodes, "episodes")
    metrics = episode_metrics(records)
    metrics["mixed_group_fraction"] = mixed_group_fraction(records)
    metrics["gen_s"] = sum(t.gen_s for e in records for t in e.turns)
    metrics["env_s"] = sum(t.env_s for e in records for t in e.turns)
    log_stage(ctx, "collect", metrics, iteration, inputs={f"iter={iteration}/turns": (ref.turns, turns_digest), f"iter={iteration}/episodes": (ref.episodes, episodes_digest)})
    get_run_logger().info("iteration %d collect: success %.3f, mixed groups %.2f", iteration, metrics["success_rate"], metrics["mixed_group_fraction"])
    return ref
