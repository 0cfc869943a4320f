"""What every task of a run receives (``RunContext``: the validated config and references to the run's
stores), and where the tasks find the run's owners (the learner, the player, the generator, the cluster):
built once at the run's start by ``horizonrl.run.owners`` and held here by the run's folder until the run
ends, so that a task asks for them by its context. A Ray worker builds the player of its shards itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from horizonrl.config import TrainConfig, run_dir
from horizonrl.run.learner import Weights
from horizonrl.run.owners import Owners, build_evaluation, build_player, build_run
from horizonrl.run.player import Player
from horizonrl.tracking.mlflow_runs import client


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


_RUNS: dict[str, Owners] = {}  # run folder -> the owners of the runs open in this process
_WORKER: list[tuple[str, Player]] = []  # a Ray worker's player: of the last run it played a shard of


def open_owners(cfg: TrainConfig, evaluation: bool = False) -> Owners:
    """Build the owners of the run ``cfg`` describes (``evaluation``: an evaluation's player alone) and join
    its Ray cluster, if it uses one; they are this process's until ``close_owners``."""
    key = str(run_dir(cfg))
    close_owners(key)  # a run opened again in this process (an earlier attempt that failed) starts afresh
    built = build_evaluation(cfg) if evaluation else build_run(cfg)
    _RUNS[key] = built
    if built.cluster is not None:
        built.cluster.join()
    return built


def owners(run: RunContext | Path) -> Owners:
    """The owners of ``run`` (its context, or its folder), opened at its start in this process."""
    key = run.run_dir if isinstance(run, RunContext) else str(run)
    if key not in _RUNS:
        raise RuntimeError(f"run {key} is not open in this process (tasks.context.open_owners)")
    return _RUNS[key]


def shard_player(ctx: RunContext) -> Player:
    """Who plays a shard of ``ctx``'s training rollouts here: the run's collector in the run's process; in
    a Ray worker, a player it builds for the run's first shard it plays and keeps for the run's next ones."""
    if ctx.run_dir in _RUNS:
        return _RUNS[ctx.run_dir].collector
    if not _WORKER or _WORKER[0][0] != ctx.run_dir:
        while _WORKER:
            _WORKER.pop()[1].close()
        _WORKER.append((ctx.run_dir, build_player(ctx.cfg, Weights(ctx.cfg.model))))
    return _WORKER[0][1]


def close_owners(key: str | Path) -> None:
    """The run in folder ``key`` ended (finished, failed or crashed): close its owners, if open here."""
    built = _RUNS.pop(str(key), None)
    if built is not None:
        built.close()
