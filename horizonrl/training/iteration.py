"""One iteration's update with its bookkeeping: the learning rate of the iteration, the PPO epochs (in this
process, or on the run's update ranks), the non-finite step budget and the checkpoint that is the
update's output. ``UpdatePlan`` is everything a run's updates share, built once at the run's start; the
learner (``horizonrl.run.learner``) calls ``update_policy`` with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from horizonrl import faults
from horizonrl.config import ModelConfig, TrainConfig
from horizonrl.training.checkpoint import CheckpointRef, checkpoint_dir, read_state, save_checkpoint
from horizonrl.training.rank_group import RankGroup
from horizonrl.training.sequences import TrainRow
from horizonrl.training.trainer import UpdateSettings, annealed_lr, ppo_update


class TooManyNonFiniteSteps(RuntimeError):
    """Raised when more optimizer steps than ``update.max_nan_skips`` had a non-finite loss or gradient."""


@dataclass(frozen=True)
class UpdatePlan:
    """What every update of a run shares: the loss settings (``settings``, for rows sampled by the checkpoint
    trained; ``for_rows`` adapts them to one update's rows), the learning-rate schedule, the AdamW weight
    decay, the non-finite budget, how many checkpoints to keep, and where the epochs run."""

    settings: UpdateSettings
    lr: float
    lr_final: float | None
    iterations: int
    weight_decay: float
    max_nan_skips: int
    keep_checkpoints: int  # an asynchronous generator still plays checkpoints up to k + 1 back
    world_size: int
    launcher: str  # torchrun | ray
    strategy: str  # ddp | fsdp
    model: ModelConfig  # how the ranks load the policy

    @classmethod
    def from_config(cls, cfg: TrainConfig, horizon: int) -> UpdatePlan:
        """The run's plan; ``horizon``: its turn horizon (Dr.GRPO's fixed length, ``UpdateSettings``)."""
        u = cfg.update
        return cls(
            UpdateSettings.from_config(cfg, 0, sampled_here=True, horizon=horizon),
            u.lr,
            u.lr_final,
            cfg.iterations,
            u.weight_decay,
            u.max_nan_skips,
            max(2, cfg.rollout.max_staleness + 2),
            u.world_size,
            u.launcher,
            u.strategy,
            cfg.model,
        )

    def for_rows(self, pad_id: int, stale: bool) -> UpdatePlan:
        """This plan for one update's rows, padded with ``pad_id`` (``UpdateSettings.for_rows``)."""
        return replace(self, settings=self.settings.for_rows(pad_id, stale))

    def lr_at(self, iteration: int) -> float:
        return annealed_lr(self.lr, self.lr_final, iteration, self.iterations)


def update_policy(
    plan: UpdatePlan,
    run_dir: Path,
    iteration: int,
    policy: CheckpointRef,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    rows: list[TrainRow],
    seed: int,
    run_state: dict[str, Any],
    estimator_state: dict | None = None,
    ref_model: torch.nn.Module | None = None,
    ranks: RankGroup | None = None,
) -> tuple[CheckpointRef, dict[str, float]]:
    """Update ``model`` (checkpoint ``policy``) on ``rows`` as ``plan`` says and write checkpoint ``iteration``.

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
    lr = plan.lr_at(iteration)
    for group in optimizer.param_groups:
        group["lr"] = lr
    stats: dict[str, float] = {"steps": 0.0, "rows": 0.0}
    nonfinite_here = 0
    if rows and ranks is None:
        with faults.nan_gradients(model, iteration):
            result = ppo_update(model, optimizer, rows, plan.settings, seed, ref_model)
        stats, nonfinite_here = result.stats, result.nonfinite_steps
    elif rows:
        out = _on_ranks(plan, ranks, run_dir, iteration, policy, rows, seed, lr)
        model.load_state_dict(out["model"])
        optimizer.load_state_dict(out["optimizer"])
        stats, nonfinite_here = out["stats"], out["nonfinite_steps"]
    faults.kill_point("update", iteration)
    nonfinite = read_state(policy).get("nonfinite_steps", 0) + nonfinite_here
    if nonfinite > plan.max_nan_skips:
        raise TooManyNonFiniteSteps(
            f"{nonfinite} optimizer steps had a non-finite loss or gradient (update.max_nan_skips = "
            f"{plan.max_nan_skips}); last good checkpoint: {policy.path}"
        )
    elapsed_s = run_state.get("elapsed_s", 0.0) + time.perf_counter() - t0
    state = {"update_stats": stats, "nonfinite_steps": nonfinite, **run_state, "elapsed_s": elapsed_s}
    keep = plan.keep_checkpoints
    ref = save_checkpoint(run_dir, iteration, model, tokenizer, optimizer, state, estimator_state, keep)
    if ranks is not None:
        ranks.advance(ref)
    return ref, {**stats, "skipped": float(not rows), "lr": lr}


def _on_ranks(
    plan: UpdatePlan,
    ranks: RankGroup,
    run_dir: Path,
    iteration: int,
    policy: CheckpointRef,
    rows: list[TrainRow],
    seed: int,
    lr: float,
) -> dict[str, Any]:
    """The epochs on the run's update ranks: rank 0 returns the whole resulting state."""
    return ranks.update(
        policy=policy.path,
        rows=rows,
        settings=plan.settings,
        seed=seed,
        lr=lr,
        weight_decay=plan.weight_decay,
        iteration=iteration,
        model=plan.model,
        reference=str(checkpoint_dir(run_dir, 0)) if plan.settings.needs_reference else None,
        strategy=plan.strategy,
    )
