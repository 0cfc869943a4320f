"""Stage 3: the PPO update over the iteration's rows; its output is the next checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from horizonrl import store
from horizonrl.seeding import derive_seed
from horizonrl.training.checkpoint import CheckpointRef
from horizonrl.training.iteration import TooManyNonFiniteSteps
from horizonrl.training.sequences import attach_advantages, train_rows
from tasks.advantage import AdvantageRef
from tasks.collect import RolloutRef
from tasks.context import RunContext, owners
from tasks.tracking import log_adapter, log_stage, weight_sync_figures

__all__ = ["TooManyNonFiniteSteps", "update"]


@task(name="update", cache_policy=NONE)
def update(
    ctx: RunContext, iteration: int, rollouts: RolloutRef, adv: AdvantageRef, policy: CheckpointRef, elapsed_s: float
) -> CheckpointRef:
    """Not retried: a half-applied update lives only in memory, so on failure the learner drops it (and
    with ``update.world_size`` > 1 stops the ranks) and the next attempt reloads ``policy`` from disk."""
    t0 = time.perf_counter()
    cfg, run = ctx.cfg, owners(ctx)
    rows = attach_advantages(
        train_rows(store.read_table(rollouts.turns, "turns"), cfg.rollout.context),
        store.read_table(adv.table, "advantages"),
    )
    # the rows were sampled by ``policy``, the checkpoint trained here, whether played in this call or stored
    # before a restart; so a resumed run takes the same pi_old path as one never stopped. With asynchronous
    # rollouts an older checkpoint may have played them: the decoupled objective (docs/algorithms.md §1.10)
    stale = bool(cfg.rollout.max_staleness) and rollouts.policy_version != policy.iteration
    run_state = {
        "elapsed_s": elapsed_s + time.perf_counter() - t0,  # the learner adds its own time
        "mlflow_run_id": ctx.mlflow_run_id,
        "seed": cfg.seed,
        "config_digest": cfg.digest(),
    }
    estimator_state = json.loads(Path(adv.state).read_text()) if adv.state else None
    seed = derive_seed(cfg.seed, "update", iteration)
    ref, stats = run.learner.update(iteration, policy, rows, stale, seed, run_state, estimator_state)
    # a synchronous run's version boundary: the player plays the new checkpoint from now on; how it reached
    # the vLLM server (None: the transformers engine plays the updated model; asynchronous: the collect syncs)
    sync = None if cfg.rollout.max_staleness else run.player.sync(ref)
    log_adapter(ctx, ref)
    if sync is not None:
        stats.update(weight_sync_figures(ctx, iteration, sync))
    _log_update(ctx, iteration, stats, skipped=not rows)
    return ref


def _log_update(ctx: RunContext, iteration: int, stats: dict[str, float], skipped: bool) -> None:
    """The update's ``update/*`` figures and its log lines."""
    log = get_run_logger()
    if skipped:
        log.info("iteration %d update: skipped, no row to learn from (every row filtered: no mixed group)", iteration)
    if stats.get("pi_old_shortcut") == 0.0:
        log.warning(
            "iteration %d update: stored sampling log-probs differ from the learner's by %.2g > update.pi_old_tol = "
            "%g on the checked rows; pi_old recomputed for every row",
            iteration,
            stats["pi_old_max_diff"],
            ctx.cfg.update.pi_old_tol,
        )
    log_stage(ctx, "update", stats, iteration)
    log.info(
        "iteration %d update: %d steps, loss %.4f, clip %.3f, kl %.4f",
        iteration,
        stats.get("steps", 0),
        stats.get("loss", 0.0),
        stats.get("clip_frac", 0.0),
        stats.get("approx_kl", 0.0),
    )
