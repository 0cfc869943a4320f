"""What every task of a run receives: the validated config and references to the run's stores; and this
process's owners of the heavy objects, built once per process and kept across stages and runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from horizonrl.config import TrainConfig
from horizonrl.run.cluster import Cluster
from horizonrl.run.learner import Learner
from horizonrl.run.player import Player
from horizonrl.tracking.mlflow_runs import client

# The policy being trained (model, tokenizer, optimizer, reference, update ranks); tasks ask it for a checkpoint.
LEARNER = Learner()
# Plays the run's episodes with the learner's weights (or the run's vLLM server); in a Ray worker, its shards.
PLAYER = Player(LEARNER)
# With asynchronous rollouts (``rollout.max_staleness`` >= 1) the generator: a second player, which the collect
# task plays with beside the update, with its own weights (no optimizer) on the transformers engine; with vLLM it
# owns the run's server and holds no weights (docs/algorithms.md §1.10).
GENERATOR = Player(Learner(trains=False))
# The Ray cluster of a run that uses one, joined at its start and left at its end.
CLUSTER = Cluster()


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


def player(cfg: TrainConfig) -> Player:
    """Who plays the training rollouts: the learner's player, or with asynchronous rollouts the generator."""
    return GENERATOR if cfg.rollout.max_staleness else PLAYER
