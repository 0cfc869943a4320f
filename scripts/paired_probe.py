"""Each run's training-task success against a control run's, paired by iteration (docs/study.md).

    .venv/bin/python scripts/paired_probe.py <experiment> <control run> <first> <last> <run> [<run> ...]

Runs of one seed with the same ``rollout`` settings sample the same tasks at every iteration, so their
``collect/success_rate`` at iteration i differ by what their updates did (and by sampling noise). The
control is the same run with its update switched off in effect (``--set update.lr=1e-12``). Prints the mean
paired difference over iterations first..last with its 95% bootstrap interval, and each run's held-out
evaluations. Reads the MLflow store of ``MLFLOW_TRACKING_URI`` (default: the project's SQLite file).
"""

from __future__ import annotations

import sys

from horizonrl.tracking import mlflow_runs, stats
from mlflow import MlflowClient


def histories(c: MlflowClient, experiment: str, run_name: str, *keys: str) -> list[dict[int, float]]:
    """Each of ``keys``' metric history (step -> value) of the run named ``run_name``."""
    run = mlflow_runs.find_run(c, experiment, run_name)
    if run is None:
        raise SystemExit(f"no run named {run_name!r} in MLflow experiment {experiment!r}")
    return [{m.step: m.value for m in c.get_metric_history(run.info.run_id, key)} for key in keys]


def main(argv: list[str]) -> int:
    if len(argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    experiment, control, first, last, names = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4:]
    c = MlflowClient(mlflow_runs.tracking_uri())
    [base] = histories(c, experiment, control, "collect/success_rate")
    for name in names:
        collect, held_out = histories(c, experiment, name, "collect/success_rate", "eval/success_rate")
        diff, n = stats.paired_difference(base, collect, first, last)
        print(
            f"{name}: collect success minus {control}'s, iterations {first}-{last} ({n}): {diff.mean:+.3f} "
            f"[{diff.low:+.3f}, {diff.high:+.3f}]; held-out {', '.join(f'{held_out[i]:.3f}' for i in sorted(held_out))}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
