"""The ``evaluate`` flow: a logged policy, found by MLflow run id or registered model name and version,
evaluated on any split of its environment, in a new MLflow run tagged with the source run.

    resolve the policy (download its checkpoint) -> the source run's config (its config.yaml artifact),
    eval settings replaced
    -> new run (tags: source run, policy URI) -> evaluate (the train flow's task) -> close the run
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from prefect import flow

import mlflow
from horizonrl.config import CONFIG_FILE, TrainConfig, load_config
from horizonrl.tracking import mlflow_runs
from mlflow import MlflowClient
from tasks.context import RunContext
from tasks.evaluate import evaluate

SOURCE_TAG = "horizonrl.source_run_id"


@flow(name="evaluate", log_prints=True)
def evaluate_policy(
    source: str,
    split: str = "test",
    n_tasks: int | None = None,
    samples: int | None = None,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``source`` (a run id, ``runs:/<run id>``, or ``models:/<name>/<version>``) on ``split``;
    returns the figures and the new run's id. The environment, decoding and seed are the source run's."""
    c = mlflow_runs.client(mlflow_runs.tracking_uri(tracking_uri))
    mlflow.set_tracking_uri(c.tracking_uri)  # the fluent API (logged models, downloads) reads the global URI
    source_run_id, model_uri = mlflow_runs.resolve_policy(c, source)
    cfg = config_of_run(c, source_run_id)
    eval_cfg = cfg.eval.model_copy(
        update={
            "split": split,
            **({"n_tasks": n_tasks, "n_tasks_ends": None} if n_tasks else {}),
            **({"samples": samples} if samples else {}),
        }
    )
    run_name = f"{cfg.run_name}--eval-{split}-{time.strftime('%Y%m%dT%H%M%S')}"
    cfg = TrainConfig.model_validate(
        {**cfg.model_dump(), "run_name": run_name, "eval": eval_cfg.model_dump(), "tracking_uri": c.tracking_uri}
    )
    policy = mlflow_runs.download_policy(model_uri, Path(cfg.data_dir) / "policies")
    tags = {
        SOURCE_TAG: source_run_id,
        "horizonrl.kind": "evaluation",
        "horizonrl.policy_uri": model_uri,
        "method": cfg.method,
        "env": cfg.env.name,
        "split": split,
        "seed": str(cfg.seed),
    }
    run_id, _ = mlflow_runs.find_or_create_run(c, cfg.experiment, run_name, tags)
    mlflow_runs.log_params(c, run_id, cfg.flat())
    ctx = RunContext(cfg, str(Path(cfg.data_dir) / cfg.experiment / run_name), c.tracking_uri, run_id)
    metrics = evaluate(ctx, policy, policy.iteration, end=True)  # a finished policy: judged as a run's last evaluation
    c.set_terminated(run_id, "FINISHED")
    print(
        f"{model_uri} on {split} ({cfg.eval.tasks_at(end=True)} tasks): success {metrics['success_rate']:.3f}; MLflow run {run_id}"
    )
    return {"run_id": run_id, "source_run_id": source_run_id, **metrics}


def config_of_run(c: MlflowClient, run_id: str) -> TrainConfig:
    """The config run ``run_id`` ran with: its ``config.yaml`` artifact, logged when the run starts."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = c.download_artifacts(run_id, CONFIG_FILE, tmp)
        except (MlflowException, OSError) as err:
            raise ValueError(
                f"run {run_id} has no {CONFIG_FILE} artifact (a train run logs it when it starts): {err}"
            ) from err
        return load_config(path)
