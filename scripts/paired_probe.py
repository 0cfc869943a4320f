"""Each run's training-task success against a control run's, paired by iteration (README, "Warm start and the study").

    .venv/bin/python scripts/paired_probe.py <experiment> <control run> <first> <last> <run> [<run> ...]

Runs of one seed with the same ``rollout`` settings sample the same tasks at every iteration, so their
``collect/success_rate`` at iteration i differ by what their updates did (and by sampling noise). The
control is the same run with its update switched off in effect (``--set update.lr=1e-12``). Prints the mean
paired difference over iterations first..last with its 95% bootstrap interval, and each run's held-out
evaluations. Reads the MLflow store of ``MLFLOW_TRACKING_URI`` (default: the project's SQLite file).
"""

from __future__ import annotations

import os
import sys

from mlflow import MlflowClient

from horizonrl import report
from horizonrl.tracking import RUN_NAME_TAG

DEFAULT_STORE = "sqlite:///mlflow/mlflow.db"


def history(c: MlflowClient, experiment_id: str, run_name: str, key: str) -> dict[int, float]:
    runs = c.search_runs([experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'")
    if len(runs) != 1:
        raise SystemExit(f"run {run_name!r}: {len(runs)} MLflow runs of that name in the experiment, expected 1")
    return {m.step: m.value for m in c.get_metric_history(runs[0].info.run_id, key)}


def main(argv: list[str]) -> int:
    if len(argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    experiment, control, first, last, names = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4:]
    c = MlflowClient(os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_STORE))
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no MLflow experiment named {experiment!r}")
    base = history(c, exp.experiment_id, control, "collect/success_rate")
    for name in names:
        diff, n = report.paired_difference(base, history(c, exp.experiment_id, name, "collect/success_rate"), first, last)
        held_out = history(c, exp.experiment_id, name, "eval/success_rate")
        print(f"{name}: collect success minus {control}'s, iterations {first}-{last} ({n}): {diff.mean:+.3f} "
              f"[{diff.low:+.3f}, {diff.high:+.3f}]; held-out {', '.join(f'{held_out[i]:.3f}' for i in sorted(held_out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
