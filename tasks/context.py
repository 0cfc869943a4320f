"""What every task of a run receives: the validated config and references to the run's stores."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from horizonrl.config import TrainConfig
from horizonrl.run.runtime import PolicyRuntime
from horizonrl.tracking.mlflow_runs import client

# The one heavy-object holder of this process (model, optimizer, engine); tasks ask it for a checkpoint.
RUNTIME = PolicyRuntime()
# With asynchronous rollouts (``rollout.max_staleness`` >= 1) the generator's own holder: the collect task plays
# with it beside the update, which trains RUNTIME's model; with vLLM it owns the run's server
# (docs/algorithms.md §1.10).
GENERATOR = PolicyRuntime(generator=True)


@dataclass(frozen=True)
class RunContext:
    cfg: TrainConfig
    run_dir: str  # <data_dir>/<experiment>/<run_name>
    tracking_uri: str
    mlflow_run_id: str

    @property
    def path(self) -> Path:
        return Path(self.run_dir)

    def mlflow(self):
        return client(self.tracking_uri)
