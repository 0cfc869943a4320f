"""The ``recompute-advantages`` flow: any method's advantages over an earlier run's stored rollouts,
without new rollouts. Stateful estimators (BLPO) chain their state through the iterations in order,
starting empty, as they would have in a run of their own.

The estimator's figures go to an MLflow run of their own, ``<run_name>--recompute-<method>`` in the
source run's experiment, tagged with the source run's id: estimators compared over the same stored
rollouts appear side by side in the UI, under the same ``advantage/...`` names as in a training run.
"""

from __future__ import annotations

from prefect import flow

from horizonrl.run import preflight, runlock
from tasks.advantage import close_recompute_run, open_recompute_run, recompute_iteration


@flow(name="recompute-advantages")
def recompute_advantages(run_dir: str, method: str, params: dict | None = None) -> dict[int, str]:
    """Write ``advantages-<method>.parquet`` into every complete ``iter=<n>`` folder of ``run_dir``, once
    every iteration's tables have passed the store's checks (nothing is written if one fails)."""
    iterations = preflight.check_recompute(run_dir)  # every input first: no earlier iteration rewritten
    written, state = {}, None
    with runlock.hold(run_dir):  # not while a train process writes the run
        run = open_recompute_run(run_dir, method, params or {})
        for d in iterations:
            path, state, _ = recompute_iteration(str(d), method, params or {}, state, run)
            written[int(d.name.split("=")[1])] = path
        close_recompute_run(run)
    return written
