"""Logging a stage's figures to the run's MLflow run (names ``<stage>/<name>``, step = iteration)."""

from __future__ import annotations

from horizonrl import tracking
from tasks.context import RunContext


def log_stage(ctx: RunContext, stage: str, metrics: dict[str, float], iteration: int, inputs: dict[str, tuple[str, str]] | None = None) -> None:
    c = ctx.mlflow()
    tracking.log_metrics(c, ctx.mlflow_run_id, stage, metrics, iteration)
    for name, (path, digest) in (inputs or {}).items():
        tracking.log_parquet_input(c, ctx.mlflow_run_id, name, path, digest)
