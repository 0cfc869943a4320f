"""Warm-start stages: the demonstrations (walkthroughs stored as Parquet) and one epoch of behaviour cloning."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow.compute as pc
from mlflow.entities import Metric
from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from horizonrl import faults, store
from horizonrl.config import WarmStartConfig
from horizonrl.files import file_digest
from horizonrl.rollout.loop import turn_horizon
from horizonrl.seeding import derive_seed
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointRef, read_state, save_checkpoint
from horizonrl.training.cloning import clone_epoch
from horizonrl.training.demonstrations import play_walkthroughs
from horizonrl.training.sequences import train_rows
from horizonrl.training.trainer import annealed_lr
from tasks.context import RunContext, owners
from tasks.tracking import log_adapter, log_stage, logged, set_run_tags


@dataclass(frozen=True)
class DemonstrationsRef:
    episodes: str  # <run_dir>/demonstrations/episodes.parquet
    turns: str


@task(name="demonstrations", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def record_demonstrations(ctx: RunContext, policy: CheckpointRef) -> DemonstrationsRef:
    """Play the walkthroughs of the first ``warmstart.demonstrations`` training tasks and store them in the
    trajectory schema (``kind = demonstration``), tokenized by ``policy``'s tokenizer; stored once, reused
    by a resumed run."""
    d = ctx.path / "demonstrations"
    ref = DemonstrationsRef(str(d / "episodes.parquet"), str(d / "turns.parquet"))
    if not (d / "episodes.parquet").is_file():
        _play_demonstrations(ctx, policy, ref)
    episodes = store.read_table(ref.episodes, "episodes", columns=["won", "n_turns", "gen_tokens"])
    stats = {
        "episodes": float(episodes.num_rows),
        "won_share": float(pc.mean(episodes["won"].cast("float64")).as_py()),
        "mean_turns": float(pc.mean(episodes["n_turns"]).as_py()),
        "action_tokens": float(pc.sum(episodes["gen_tokens"]).as_py()),
    }
    inputs = {
        f"demonstrations/{name}": (path, file_digest(path))
        for name, path in (("turns", ref.turns), ("episodes", ref.episodes))
    }
    log_stage(ctx, "demonstrations", stats, 0, inputs=inputs)
    get_run_logger().info(
        "%d demonstrations (%.0f%% won, %.1f turns on average) in %s",
        episodes.num_rows,
        100 * stats["won_share"],
        stats["mean_turns"],
        ref.episodes,
    )
    return ref


def _play_demonstrations(ctx: RunContext, policy: CheckpointRef, ref: DemonstrationsRef) -> None:
    """Play the walkthroughs with the run's suite, in ``policy``'s chat format, and store them."""
    cfg, ws, player = ctx.cfg, ctx.cfg.warmstart, owners(ctx).player
    records = play_walkthroughs(
        player.suite,
        player.suite.tasks("train", cfg.env.tier, ws.demonstrations),
        player.chat_format(policy),
        action_mode=cfg.rollout.action_mode,
        context=cfg.rollout.context,
        history_turns=cfg.rollout.history_turns,
        max_turns=turn_horizon(cfg.env, player.suite),
        perturbed_share=ws.perturbed_share,
        seed=cfg.seed,
        expert=ws.expert,
    )
    store.write_table(store.turns_table(records, 0), ref.turns, "turns")
    store.write_table(store.episodes_table(records, cfg.run_name, 0, 0), ref.episodes, "episodes")


@task(name="clone", cache_policy=NONE)
def clone(ctx: RunContext, epoch: int, demos: DemonstrationsRef, policy: CheckpointRef) -> CheckpointRef:
    """One epoch of behaviour cloning from ``policy``; its output is checkpoint ``epoch``. Logs the loss of
    every optimizer step (``clone/loss``, step = optimizer step) and the epoch's mean (``clone/epoch_loss``).
    Not retried, like the PPO update: a half-applied epoch lives only in memory."""
    cfg, ws, learner = ctx.cfg, ctx.cfg.warmstart, owners(ctx).learner
    loaded = learner.get(policy)
    try:
        lr = _clone_lr(ws, epoch)
        for group in loaded.optimizer.param_groups:
            group["lr"] = lr
        rows = train_rows(store.read_table(demos.turns, "turns"), cfg.rollout.context)
        losses = clone_epoch(
            loaded.model,
            loaded.optimizer,
            rows,
            ws.minibatch_size,
            cfg.update.grad_clip,
            loaded.tokenizer.pad_token_id,
            derive_seed(cfg.seed, "clone", epoch),
            cfg.update.micro_batch_tokens,
        )
        state = {
            "clone_losses": losses,
            "elapsed_s": 0.0,
            "nonfinite_steps": 0,
            "mlflow_run_id": ctx.mlflow_run_id,
            "seed": cfg.seed,
            "config_digest": cfg.digest(),
        }
        ref = save_checkpoint(ctx.path, epoch, loaded.model, loaded.tokenizer, loaded.optimizer, state)
    except BaseException:
        learner.weights.drop()
        raise
    faults.kill_point("clone", epoch)
    learner.weights.advance(ref)
    log_adapter(ctx, ref)
    log_losses(ctx, ref)
    get_run_logger().info(
        "epoch %d: %d steps at lr %.2g, loss %.4f -> %.4f", epoch, len(losses), lr, losses[0], losses[-1]
    )
    return ref


@task(name="register-warm-start", retries=1, retry_delay_seconds=2, cache_policy=NONE)
def register_warm_start(ctx: RunContext) -> str:
    """Register the run's logged policy as ``warmstart.model_name`` (a finished warm start run again registers
    nothing new) and tag the run with it; returns the ``models:/<name>/<version>`` URI. Retried: it writes
    to the tracking store."""
    name = ctx.cfg.warmstart.model_name
    version = mlflow_runs.register_policy(ctx.mlflow(), ctx.mlflow_run_id, name)
    model_uri = f"models:/{name}/{version}"
    set_run_tags(ctx, {"horizonrl.registered_model": model_uri})
    return model_uri


def log_losses(ctx: RunContext, ref: CheckpointRef) -> None:
    """Log checkpoint ``ref``'s epoch losses and learning rate once (also after a crash between its
    checkpoint and its log)."""
    losses = read_state(ref).get("clone_losses")
    if not losses or logged(ctx, "clone/epoch_loss", ref.iteration):
        return
    first_step, now = (ref.iteration - 1) * len(losses), int(time.time() * 1000)
    metrics = [Metric("clone/loss", loss, now, first_step + k) for k, loss in enumerate(losses)]
    for i in range(0, len(metrics), 1000):  # MLflow's batch limit
        ctx.mlflow().log_batch(ctx.mlflow_run_id, metrics=metrics[i : i + 1000])
    log_stage(
        ctx,
        "clone",
        {"epoch_loss": sum(losses) / len(losses), "lr": _clone_lr(ctx.cfg.warmstart, ref.iteration)},
        ref.iteration,
    )


def _clone_lr(ws: WarmStartConfig, epoch: int) -> float:
    """The cloning rate of ``epoch`` (1-based): ``warmstart.lr``, annealed to ``warmstart.lr_final``."""
    return annealed_lr(ws.lr, ws.lr_final, epoch, ws.epochs)
