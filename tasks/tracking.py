"""Logging a stage's figures to the run's MLflow run (names ``<stage>/<name>``, step = iteration).

Logging is idempotent per (stage, iteration): a resumed or retried stage whose figures are already in
MLflow logs nothing, so metric histories never hold a step twice.
"""

from __future__ import annotations

from horizonrl import tracking
from tasks.context import RunContext


def logged(ctx: RunContext, key: str, iteration: int) -> bool:
    return any(m.step == iteration for m in ctx.mlflow().get_metric_history(ctx.mlflow_run_id, key))


def log_stage(ctx: RunContext, stage: str, metrics: dict[str, float], iteration: int, inputs: dict[str, tuple[str, str]] | None = None) -> None:
    if not metrics or logged(ctx, f"{stage}/{sorted(metrics)[0]}", iteration):
        return
    c = ctx.mlflow()
    tracking.log_metrics(c, ctx.mlflow_run_id, stage, metrics, iteration)
    for name, (path, digest) in (inputs or {}).items():
        tracking.log_parquet_input(c, ctx.mlflow_run_id, name, path, digest)
