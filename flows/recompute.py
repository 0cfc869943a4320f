"""The ``recompute-advantages`` flow: any method's advantages over an earlier run's stored rollouts,
without new rollouts. Stateful estimators (BLPO) chain their state through the iterations in order,
starting empty, as they would have in a run of their own.

The estimator's figures go to an MLflow run of their own, ``<run_name>--recompute-<method>`` in the
source run's experiment, tagged with the source run's id: estimators compared over the same stored
rollouts appear side by side in the UI, under the same ``advantage/...`` names as in a training run.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from horizonrl import faults
from horizonrl.config import load_config
from horizonrl.run import preflight, runlock
from horizonrl.tracking import mlflow_runs
from tasks.advantage import recompute_iteration, shared_names


@flow(name="recompute-advantages")
def recompute_advantages(run_dir: str, method: str, params: dict | None = None) -> dict[int, str]:
    """Write ``advantages-<method>.parquet`` into every complete ``iter=<n>`` folder of ``run_dir``, once
    every iteration's tables have passed the store's checks (nothing is written if one fails)."""
    iterations = preflight.check_recompute(run_dir)  # every input first: no earlier iteration rewritten
    written, state = {}, None
    with runlock.hold(run_dir):  # not while a train process writes the run
        c, run_id = _recompute_run(Path(run_dir), method, params or {})
        for d in iterations:
            path, state, stats = recompute_iteration(str(d), method, params or {}, state)
            it = int(d.name.split("=")[1])
            faults.kill_point("recompute", it)
            written[it] = path
            if not any(
                m.step == it for m in c.get_metric_history(run_id, "advantage/trajectories")
            ):  # a rerun logs no step twice
                mlflow_runs.log_metrics(c, run_id, "advantage", shared_names(stats, method), it)
        c.set_terminated(run_id, "FINISHED")
    return written


def _recompute_run(run_dir: Path, method: str, params: dict):
    """The MLflow run of this recomputation (found again by name), linked to the source run."""
    cfg = load_config(run_dir / "config.yaml", []) if (run_dir / "config.yaml").is_file() else None
    experiment, run_name = (cfg.experiment, cfg.run_name) if cfg else (run_dir.parent.name, run_dir.name)
    c = mlflow_runs.client(mlflow_runs.tracking_uri(cfg.tracking_uri if cfg else None))
    source = mlflow_runs.find_run(c, experiment, run_name)
    tags = {
        "horizonrl.kind": "recompute",
        "horizonrl.source_run": run_name,
        "method": method,
        **({"horizonrl.source_run_id": source.info.run_id} if source else {}),
    }
    run_id, resumed = mlflow_runs.find_or_create_run(c, experiment, f"{run_name}--recompute-{method}", tags)
    if not resumed:
        mlflow_runs.log_params(
            c,
            run_id,
            {"method": method, "run_dir": str(run_dir), **{f"advantage_params.{k}": v for k, v in params.items()}},
        )
    return c, run_id
