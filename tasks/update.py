"""Stage 3: the PPO update over the iteration's rows; its output is the next checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from horizonrl import store
from horizonrl.rollout.loop import turn_horizon
from horizonrl.seeding import derive_seed
from horizonrl.training.checkpoint import CheckpointRef
from horizonrl.training.iteration import TooManyNonFiniteSteps, update_policy
from horizonrl.training.sequences import attach_advantages, train_rows
from horizonrl.training.trainer import UpdateSettings
from tasks.advantage import AdvantageRef
from tasks.collect import RolloutRef
from tasks.context import LEARNER, PLAYER, RunContext
from tasks.tracking import log_adapter, log_stage, weight_sync_figures

__all__ = ["TooManyNonFiniteSteps", "update"]


@task(name="update", cache_policy=NONE)
def update(
    ctx: RunContext, iteration: int, rollouts: RolloutRef, adv: AdvantageRef, policy: CheckpointRef, elapsed_s: float
) -> CheckpointRef:
    """Not retried: a half-applied update lives only in memory, so on failure the learner drops it (and
    with ``update.world_size`` > 1 stops the ranks) and the next attempt reloads ``policy`` from disk."""
    t0 = time.perf_counter()
    cfg = ctx.cfg
    loaded = LEARNER.get(cfg, policy)
    try:
        rows = attach_advantages(
            train_rows(store.read_table(rollouts.turns, "turns"), cfg.rollout.context),
            store.read_table(adv.table, "advantages"),
        )
        # the rows were sampled by ``policy``, the checkpoint trained here, whether played in this call or
        # stored before a restart; so a resumed run takes the same pi_old path as one never stopped. With
        # asynchronous rollouts an older checkpoint may have played them: the decoupled objective
        # (docs/algorithms.md §1.10)
        stale = bool(cfg.rollout.max_staleness) and rollouts.policy_version != policy.iteration
        s = UpdateSettings.from_config(
            cfg,
            loaded.tokenizer.pad_token_id,
            sampled_here=not stale,
            decoupled=stale,
            horizon=turn_horizon(cfg, PLAYER.suite(cfg)),
        )
        ranks = LEARNER.update_ranks(cfg, ctx.path) if cfg.update.world_size > 1 and rows else None
        ref_model = LEARNER.reference(cfg, ctx.path) if s.needs_reference and ranks is None else None
        ref, stats = update_policy(
            cfg,
            ctx.path,
            iteration,
            policy,
            loaded.model,
            loaded.tokenizer,
            loaded.optimizer,
            rows,
            s,
            derive_seed(cfg.seed, "update", iteration),
            {
                "elapsed_s": elapsed_s + time.perf_counter() - t0,  # update_policy adds its own time
                "mlflow_run_id": ctx.mlflow_run_id,
                "seed": cfg.seed,
                "config_digest": cfg.digest(),
            },
            json.loads(Path(adv.state).read_text()) if adv.state else None,
            ref_model,
            ranks,
        )
    except BaseException:
        LEARNER.drop()
        LEARNER.close_update_ranks()
        raise
    LEARNER.advance(ref)
    # a synchronous run's version boundary: the player plays the new checkpoint from now on; how it reached
    # the vLLM server (None: the transformers engine plays the updated model; asynchronous: the collect syncs)
    sync = None if cfg.rollout.max_staleness else PLAYER.sync(cfg, ref)
    log_adapter(ctx, ref)
    if sync is not None:
        stats.update(weight_sync_figures(ctx, iteration, sync))
    if not rows:
        get_run_logger().info(
            "iteration %d update: skipped, no row to learn from (every row filtered: no mixed group)", iteration
        )
    if stats.get("pi_old_shortcut") == 0.0:
        get_run_logger().warning(
            "iteration %d update: stored sampling log-probs differ from the learner's by %.2g > update.pi_old_tol = "
            "%g on the checked rows; pi_old recomputed for every row",
            iteration,
            stats["pi_old_max_diff"],
            cfg.update.pi_old_tol,
        )
    log_stage(ctx, "update", stats, iteration)
    get_run_logger().info(
        "iteration %d update: %d steps, loss %.4f, clip %.3f, kl %.4f",
        iteration,
        stats.get("steps", 0),
        stats.get("loss", 0.0),
        stats.get("clip_frac", 0.0),
        stats.get("approx_kl", 0.0),
    )
    return ref
