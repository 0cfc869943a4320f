"""MLflow bookkeeping: one run per training run, found again by name on resume.

Prefect runs tasks in worker threads and MLflow's active run is per thread, so everything here takes an
explicit run id and uses ``MlflowClient``. Metric names are ``<stage>/<name>`` with the iteration as step.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, Run, RunTag

RUN_NAME_TAG = "horizonrl.run_name"
DEFAULT_STORE = "mlflow"


def tracking_uri(configured: str | None = None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else SQLite under ./mlflow (created on first use)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    Path(DEFAULT_STORE).mkdir(exist_ok=True)
    return f"sqlite:///{DEFAULT_STORE}/mlflow.db"


def client(uri: str) -> MlflowClient:
    _create_sqlite_store_once(uri)
    return MlflowClient(tracking_uri=uri)


@functools.cache
def _create_sqlite_store_once(uri: str) -> None:
    """Open a SQLite store first under a file lock: MLflow creates its tables on first use, and two runs
    starting at once on a new store collide ("table _alembic_tmp_experiments already exists")."""
    if not uri.startswith("sqlite:///"):
        return
    lock = Path(uri.removeprefix("sqlite:///") + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def experiment_id(c: MlflowClient, name: str) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifacts = None
    if c.tracking_uri.startswith("sqlite:"):
        artifacts = (Path(DEFAULT_STORE) / "artifacts").resolve().as_uri()
    try:
        return c.create_experiment(name, artifact_location=artifacts)
    except mlflow.exceptions.MlflowException:  # created concurrently by another run
        return c.get_experiment_by_name(name).experiment_id


def find_run(c: MlflowClient, experiment: str, run_name: str) -> Run | None:
    """The newest run tagged with ``run_name`` in ``experiment``, or None."""
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return None
    found = c.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", order_by=["attributes.start_time DESC"], max_results=1)
    return found[0] if found else None


def find_or_create_run(c: MlflowClient, experiment: str, run_name: str, tags: dict[str, str]) -> tuple[str, bool]:
    """Return (run_id, resumed): the newest run tagged with ``run_name`` (set RUNNING again), or a new one."""
    found = find_run(c, experiment, run_name)
    if found:
        run_id = found.info.run_id
        c.update_run(run_id, status="RUNNING")
        return run_id, True
    return create_run(c, experiment, run_name, tags), False


def create_run(c: MlflowClient, experiment: str, run_name: str, tags: dict[str, str]) -> str:
    """A new run named ``run_name`` (tagged so ``find_run`` finds it); returns its id."""
    all_tags = {RUN_NAME_TAG: run_name, "mlflow.runName": run_name, **tags}
    return c.create_run(experiment_id(c, experiment), run_name=run_name, tags=all_tags).info.run_id


def log_params(c: MlflowClient, run_id: str, params: dict[str, str]) -> None:
    items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i : i + 100])


def log_metrics(c: MlflowClient, run_id: str, stage: str, values: dict[str, float], step: int) -> None:
    """Log ``<stage>/<name>`` for every finite value at ``step``."""
    now = int(time.time() * 1000)
    metrics = [Metric(f"{stage}/{k}", float(v), now, step) for k, v in sorted(values.items()) if v == v and abs(float(v)) != float("inf")]
    for i in range(0, len(metrics), 1000):
        c.log_batch(run_id, metrics=metrics[i : i + 1000])


def log_parquet_input(c: MlflowClient, run_id: str, name: str, path: str | Path, digest: str, context: str = "training") -> None:
    """Record a Parquet file as a run input dataset (path plus content digest)."""
    ds = Dataset(name=name, digest=digest[:36], source_type="local", source=json.dumps({"uri": str(Path(path).resolve())}))
    c.log_inputs(run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)])])


def log_table(c: MlflowClient, run_id: str, frame: pd.DataFrame, artifact_file: str) -> None:
    """Log ``frame`` as a table artifact, once: MLflow appends to a table that exists, so a retried
    stage logging it again would double its rows."""
    folder = os.path.dirname(artifact_file) or None
    if any(a.path == artifact_file for a in c.list_artifacts(run_id, folder)):
        return
    c.log_table(run_id, data=frame, artifact_file=artifact_file)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def set_tags(c: MlflowClient, run_id: str, tags: dict[str, Any]) -> None:
    c.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in sorted(tags.items())])
