"""Logging a stage's figures to the run's MLflow run (names ``<stage>/<name>``, step = iteration), and
its episodes as MLflow traces (``horizonrl.tracking.traces``).

Logging is idempotent per (stage, iteration): a resumed or retried stage whose figures are already in
MLflow logs nothing, so metric histories never hold a step twice; a trace already in the store is not
logged again either.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import TYPE_CHECKING

import pyarrow as pa
from prefect import get_run_logger

from horizonrl import store
from horizonrl.files import file_digest
from horizonrl.models import lora
from horizonrl.rollout.metrics import episode_metrics
from horizonrl.seeding import derive_seed
from horizonrl.tracking import mlflow_runs, traces
from horizonrl.training.checkpoint import CheckpointRef
from tasks.context import RunContext

if TYPE_CHECKING:
    from horizonrl.engines.vllm import WeightSync


def logged(ctx: RunContext, key: str, iteration: int) -> bool:
    return any(m.step == iteration for m in ctx.mlflow().get_metric_history(ctx.mlflow_run_id, key))


def log_stage(
    ctx: RunContext,
    stage: str,
    metrics: dict[str, float],
    iteration: int,
    inputs: dict[str, tuple[str, str]] | None = None,
) -> None:
    if not metrics or logged(ctx, f"{stage}/{sorted(metrics)[0]}", iteration):
        return
    c = ctx.mlflow()
    mlflow_runs.log_metrics(c, ctx.mlflow_run_id, stage, metrics, iteration)
    for name, (path, digest) in (inputs or {}).items():
        mlflow_runs.log_parquet_input(c, ctx.mlflow_run_id, name, path, digest)


def log_startup(ctx: RunContext, started: str | None, iteration: int) -> None:
    """``time/startup_s``: from the process's start (``started``, Unix time as text; None: not a command's
    process, e.g. a sweep cell or a deployment) to the run's first stage: imports, Prefect's API server,
    opening the run."""
    if started is not None:
        log_stage(ctx, "time", {"startup_s": time.time() - float(started)}, iteration)


def log_iteration(ctx: RunContext, iteration: int, seconds: float, elapsed_s: float, env_steps: int) -> None:
    """An iteration's ``time/*`` figures (its wall seconds, the run's training seconds and environment steps
    so far) and ``system/max_rss_mb``, the process's peak memory."""
    figures = {"iteration_s": seconds, "train_s": elapsed_s, "env_steps": env_steps}
    log_stage(ctx, "time", figures, iteration)
    log_stage(ctx, "system", {"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, iteration)


def set_run_tags(ctx: RunContext, tags: dict[str, str]) -> None:
    """Tags on the run's MLflow run (set again with the same value on a retry or resume)."""
    mlflow_runs.set_tags(ctx.mlflow(), ctx.mlflow_run_id, tags)


def log_adapter(ctx: RunContext, ref: CheckpointRef) -> None:
    """A LoRA run's new checkpoint: its adapter files go to the run (``adapters/iter=<n>/``), so each
    version can be served without the run folder. Full-weight checkpoints log nothing here."""
    if lora.is_adapter_dir(ref.path):
        mlflow_runs.log_adapter(ctx.mlflow(), ctx.mlflow_run_id, ref.path, ref.iteration)


def weight_sync_figures(ctx: RunContext, iteration: int, sync: WeightSync) -> dict[str, float]:
    """How a checkpoint reached the vLLM server: ``time/weight_sync_s`` logged, a warning when it fell back
    (restart) with the reason; returns the stage's figures (``weight_sync_in_place``, the probe's difference)."""
    log_stage(ctx, "time", {"weight_sync_s": sync.seconds}, iteration)
    if sync.reason is not None:
        get_run_logger().warning(
            "iteration %d: vLLM weights by %s (%.1f s): %s", iteration, sync.path, sync.seconds, sync.reason
        )
    figures = {"weight_sync_in_place": float(sync.path in ("in_place", "adapter"))}
    if sync.probe_max_diff is not None:
        figures["weight_sync_probe_diff"] = sync.probe_max_diff
    return figures


def _target(ctx: RunContext) -> traces.TraceTarget:
    cfg = ctx.cfg
    return traces.TraceTarget(ctx.tracking_uri, ctx.mlflow_run_id, cfg.run_name, cfg.method, cfg.seed)


def trace_training(ctx: RunContext, iteration: int, episodes_path: str, turns_path: str, advantages: pa.Table) -> None:
    """The iteration's sample of training episodes as traces, with each turn's advantage; figures under
    ``trace/train/``."""
    if not ctx.cfg.trace.train_sample:
        return
    episodes = store.read_table(episodes_path, "episodes")
    chosen = traces.training_sample(episodes, ctx.cfg.trace.train_random, derive_seed(ctx.cfg.seed, "trace", iteration))
    episodes = store.select_rollouts(episodes, chosen)
    turns = store.read_table(turns_path, "turns", columns=traces.TURN_COLUMNS)
    stats = traces.log_episodes(
        _target(ctx), "train", iteration, episodes, turns, advantages, file_digest(episodes_path)
    )
    log_stage(ctx, "trace/train", stats, iteration)


def trace_evaluation(ctx: RunContext, iteration: int, episodes: pa.Table, turns: pa.Table) -> None:
    """The first ``trace.eval_episodes`` held-out episodes (by rollout id) of an evaluation's ``episodes`` and
    ``turns`` as played, as traces; figures under ``trace/eval/``."""
    chosen = sorted(episodes["rollout_id"].to_pylist())[: ctx.cfg.trace.eval_episodes]
    if not chosen:
        return
    picked = store.select_rollouts(episodes, chosen)
    stats = traces.log_episodes(_target(ctx), "eval", iteration, picked, store.select_rollouts(turns, chosen))
    log_stage(ctx, "trace/eval", stats, iteration)


def log_success_by_env_steps(ctx: RunContext, env_steps: int, success: float) -> None:
    """``eval/success_by_env_steps``: held-out success with the run's cumulative environment steps as the
    step (``store.env_steps``, APPO's branches included, as the train flow counts them for ``time/env_steps``
    and the step budget), so the experiment's chart view plots every run's success against the same x."""
    if not logged(ctx, "eval/success_by_env_steps", env_steps):
        mlflow_runs.log_metrics(ctx.mlflow(), ctx.mlflow_run_id, "eval", {"success_by_env_steps": success}, env_steps)


class Progress:
    """A run's progress where people look: one live line on the terminal (tqdm: iteration i/N, the
    iteration's rollout success and mean return, seconds per iteration, time left), quiet under CI or
    without a terminal; and a Prefect progress artifact that the flow run's page shows while it runs."""

    def __init__(self, ctx: RunContext, done: int):
        from prefect.artifacts import create_progress_artifact
        from tqdm import tqdm

        self.total = ctx.cfg.iterations
        quiet = bool(os.environ.get("CI")) or not sys.stderr.isatty()
        self.bar = tqdm(
            total=self.total, initial=done, desc=ctx.cfg.run_name, unit="it", disable=quiet, dynamic_ncols=True
        )
        self.artifact = create_progress_artifact(
            100.0 * done / self.total, description=f"{ctx.cfg.run_name}: iterations done of {self.total}"
        )

    def advance(self, iteration: int, episodes_path: str) -> None:
        """After ``iteration``'s update: the line moves on by one, with the figures of its rollouts."""
        from prefect.artifacts import update_progress_artifact

        m = episode_metrics(store.read_table(episodes_path, "episodes"))
        self.bar.set_postfix(
            success=f"{m.get('success_rate', 0.0):.3f}", mean_return=f"{m.get('mean_return', 0.0):.2f}", refresh=False
        )
        self.bar.update(1)
        update_progress_artifact(self.artifact, 100.0 * iteration / self.total)

    def close(self) -> None:
        self.bar.close()
