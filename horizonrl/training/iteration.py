"""One iteration's update with its bookkeeping: the learning rate of the iteration, the PPO epochs (in this
process, or on the run's update ranks), the non-finite step budget and the checkpoint that is the
update's output. The update task is this call plus logging.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from horizonrl import faults
from horizonrl.config import TrainConfig
from horizonrl.training.checkpoint import CheckpointRef, checkpoint_dir, read_state, save_checkpoint
from horizonrl.training.rank_group import RankGroup
from horizonrl.training.sequences import TrainRow
from horizonrl.training.trainer import UpdateSettings, annealed_lr, ppo_update


class TooManyNonFiniteSteps(RuntimeError):
    """Raised when more optimizer steps than ``update.max_nan_skips`` had a non-finite loss or gradient."""


def update_policy(
    cfg: TrainConfig,
    run_dir: Path,
    iteration: int,
    policy: CheckpointRef,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    rows: list[TrainRow],
    s: UpdateSettings,
    seed: int,
    run_state: dict[str, Any],
    estimator_state: dict | None = None,
    ref_model: torch.nn.Module | None = None,
    ranks: RankGroup | None = None,
) -> tuple[CheckpointRef, dict[str, float]]:
    """Update ``model`` (checkpoint ``policy``) on ``rows`` and write checkpoint ``iteration``.

    With ``ranks`` the epochs run there (``update.world_size`` processes) and their resulting weights and
    AdamW state are loaded into ``model`` and ``optimizer`` before the checkpoint is written, so the
    checkpoint is the same whole state whatever the world size. ``run_state``: the run's fields of the
    checkpoint's state (MLflow run id, seed, config digest, and ``elapsed_s``, the run's training time when
    this call began). The checkpoint's ``elapsed_s`` adds this update's own time, so a resume counts
    the training time up to the save, not the time before the update, which lost an update per resume.

    Returns:
        The new checkpoint, and the update's figures with ``lr`` and ``skipped`` added.

    Raises:
        TooManyNonFiniteSteps: the run's non-finite steps exceed ``update.max_nan_skips``.
        RankFailed: a rank died or raised (the ranks are stopped; the next attempt starts new ones).
    """
    t0 = time.perf_counter()
    lr = annealed_lr(cfg.update.lr, cfg.update.lr_final, iteration, cfg.iterations)
    for group in optimizer.param_groups:
        group["lr"] = lr
    stats: dict[str, float] = {"steps": 0.0, "rows": 0.0}
    nonfinite_here = 0
    if rows and ranks is None:
        with faults.nan_gradients(model, iteration):
            result = ppo_update(model, optimizer, rows, s, seed, ref_model)
        stats, nonfinite_here = result.stats, result.nonfinite_steps
    elif rows:
        out = ranks.update(
            policy=policy.path,
            rows=rows,
            settings=s,
            seed=seed,
            lr=lr,
            weight_decay=cfg.update.weight_decay,
            iteration=iteration,
            model=cfg.model,
            reference=str(checkpoint_dir(run_dir, 0)) if s.needs_reference else None,
            strategy=cfg.update.strategy,
        )
        model.load_state_dict(out["model"])
        optimizer.load_state_dict(out["optimizer"])
        stats, nonfinite_here = out["stats"], out["nonfinite_steps"]
    faults.kill_point("update", iteration)
    nonfinite = read_state(policy).get("nonfinite_steps", 0) + nonfinite_here
    if nonfinite > cfg.update.max_nan_skips:
        raise TooManyNonFiniteSteps(
            f"{nonfinite} optimizer steps had a non-finite loss or gradient (update.max_nan_skips = "
            f"{cfg.update.max_nan_skips}); last good checkpoint: {policy.path}"
        )
    elapsed_s = run_state.get("elapsed_s", 0.0) + time.perf_counter() - t0
    state = {"update_stats": stats, "nonfinite_steps": nonfinite, **run_state, "elapsed_s": elapsed_s}
    # an asynchronous generator still plays (or, after a restart, plays again) checkpoints up to k + 1 back
    keep = max(2, cfg.rollout.max_staleness + 2)
    ref = save_checkpoint(run_dir, iteration, model, tokenizer, optimizer, state, estimator_state, keep)
    if ranks is not None:
        ranks.advance(ref)
    return ref, {**stats, "skipped": float(not rows), "lr": lr}
