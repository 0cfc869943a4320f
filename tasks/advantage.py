"""Stage 2: compute the method's advantages over stored rollouts; write them next to the rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from prefect import get_run_logger, task
from prefect.cache_policies import NONE

import methods
from horizonrl import faults, store
from horizonrl.config import load_config
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointRef, read_estimator_state
from horizonrl.training.sequences import step_batch
from methods.presets import estimator_of
from methods.types import StepBatch
from tasks.collect import RolloutRef
from tasks.context import RunContext
from tasks.tracking import log_stage, trace_training

# Figures every estimator reports under the same name; the rest are logged as advantage/<method>/<name>.
SHARED_FIGURES = {"zero_group_fraction", "kept_fraction", "adv_mean", "adv_abs_mean", "groups", "trajectories"}


@dataclass(frozen=True)
class AdvantageRef:
    iteration: int
    table: str  # advantages-<method>.parquet
    state: str | None  # estimator state after this batch (JSON), None for stateless estimators


def compute_advantages(
    rollouts: RolloutRef, name: str, params: object, state_in: dict | None, update_index: int
) -> tuple[pa.Table, dict | None, dict[str, float]]:
    """Run estimator ``name`` over one iteration's stored rollouts. Pure apart from reading Parquet.

    Episodes that ended in an environment error are left out of the estimate (their return says nothing
    about the policy, and counting them as failures would bias their group); their rows get advantage 0
    and ``keep=False``."""
    turns = store.read_table(rollouts.turns, "turns")
    episodes = store.read_table(rollouts.episodes, "episodes")
    errored = pc.is_in(
        turns["rollout_id"], value_set=episodes.filter(pc.equal(episodes["status"], "error"))["rollout_id"]
    )
    left_out = turns.filter(errored)
    turns = turns.filter(pc.invert(errored))
    batch = step_batch(episodes, turns, update_index)
    entry = methods.ADVANTAGES.get(name)
    state = methods.state_from_json(name, state_in, params)
    result = entry.fn(batch, params, state)
    table = store.advantages_table(
        batch.traj_id, batch.turn, result.adv, result.keep, result.adv_tokens, batch.n_tokens
    )
    if left_out.num_rows:
        n = left_out.num_rows
        left = store.advantages_table(
            left_out["rollout_id"].to_numpy(), left_out["turn"].to_numpy(), np.zeros(n), np.zeros(n, dtype=bool)
        )
        table = pa.concat_tables([table, left])
    return table, methods.state_to_json(result.state), {**shared_figures(batch, result.adv), **result.stats}


def shared_figures(batch: StepBatch, adv: np.ndarray) -> dict[str, float]:
    """The figures every method logs under the same name (an estimator's own value of one wins):
    rows' mean and mean absolute advantage, trajectories, groups, the share of groups whose rows all
    have advantage 0 (no signal)."""
    zero = pd.Series(adv == 0).groupby(batch.group_id).all() if len(adv) else pd.Series(dtype=bool)
    return {
        "adv_mean": float(adv.mean()) if len(adv) else 0.0,
        "adv_abs_mean": float(np.abs(adv).mean()) if len(adv) else 0.0,
        "trajectories": float(len(np.unique(batch.traj_id))),
        "groups": float(len(zero)),
        "zero_group_fraction": float(zero.mean()) if len(zero) else 0.0,
    }


def shared_names(stats: dict[str, float], method: str) -> dict[str, float]:
    """Figures every method reports keep their name; the rest go under ``<method>/``."""
    return {(k if k in SHARED_FIGURES else f"{method}/{k}"): v for k, v in stats.items()}


@task(name="advantage", cache_policy=NONE)
def advantages(ctx: RunContext, iteration: int, rollouts: RolloutRef, policy: CheckpointRef) -> AdvantageRef:
    """Estimator state (BLPO memory) comes from the policy's checkpoint, so a resumed run computes
    bit-identical advantages. No Prefect cache: the computation is cheap and deterministic."""
    cfg = ctx.cfg
    name, params = cfg.advantage_spec()
    table, state, stats = compute_advantages(rollouts, name, params, read_estimator_state(policy), policy.iteration)
    path, digest, state_path = store.write_advantages(Path(rollouts.turns).parent, cfg.method, table, state)
    faults.kill_point("advantage", iteration)
    kept = table["keep"].to_numpy(zero_copy_only=False)
    stats.setdefault("kept_fraction", float(kept.mean()) if len(kept) else 0.0)
    stats = shared_names(stats, cfg.method)
    log_stage(
        ctx, "advantage", stats, iteration, inputs={f"iter={iteration}/advantages-{cfg.method}": (str(path), digest)}
    )
    trace_training(ctx, iteration, rollouts.episodes, rollouts.turns, table)
    get_run_logger().info("iteration %d advantage (%s): kept %.2f of rows", iteration, name, stats["kept_fraction"])
    return AdvantageRef(iteration, str(path), str(state_path) if state_path else None)


@dataclass(frozen=True)
class RecomputeRun:
    """The MLflow run of a recomputation: ``<run_name>--recompute-<method>`` in the source run's experiment."""

    tracking_uri: str
    run_id: str


@task(name="recompute-open", retries=1, retry_delay_seconds=2, cache_policy=NONE)
def open_recompute_run(run_dir: str, method: str, params: dict) -> RecomputeRun:
    """The MLflow run of recomputing ``method`` over the run in ``run_dir`` (found again by name), tagged with
    the source run; its params (method, folder, estimator parameters) logged once. Retried: it writes to
    the tracking store."""
    d = Path(run_dir)
    cfg = load_config(d / "config.yaml", []) if (d / "config.yaml").is_file() else None
    experiment, run_name = (cfg.experiment, cfg.run_name) if cfg else (d.parent.name, d.name)
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
        own = {"method": method, "run_dir": str(d), **{f"advantage_params.{k}": v for k, v in params.items()}}
        mlflow_runs.log_params(c, run_id, own)
    return RecomputeRun(c.tracking_uri, run_id)


@task(name="recompute-advantage", cache_policy=NONE)
def recompute_iteration(
    iteration_dir: str, method: str, params: dict, state_in: dict | None, run: RecomputeRun | None = None
) -> tuple[str, dict | None, dict[str, float]]:
    """Advantages of ``method`` over one stored iteration, written next to the original rollouts as
    ``advantages-<method>.parquet`` (other methods' tables are left alone), and with ``run`` the figures
    logged there under the training run's names (once: a rerun logs no step twice). Returns (path, state,
    stats)."""
    d = Path(iteration_dir)
    name = estimator_of(method)
    entry = methods.ADVANTAGES.get(name)
    episodes = store.read_table(d / "episodes.parquet", "episodes", columns=["policy_version"])
    update_index = int(episodes["policy_version"][0].as_py()) if episodes.num_rows else 0
    ref = RolloutRef(-1, str(d / "episodes.parquet"), str(d / "turns.parquet"))
    table, state, stats = compute_advantages(ref, name, entry.params_cls(**params), state_in, update_index)
    path, _, _ = store.write_advantages(d, method, table, state)
    it = int(d.name.split("=")[1])
    faults.kill_point("recompute", it)
    if run is not None:
        c = mlflow_runs.client(run.tracking_uri)
        if not any(m.step == it for m in c.get_metric_history(run.run_id, "advantage/trajectories")):
            mlflow_runs.log_metrics(c, run.run_id, "advantage", shared_names(stats, method), it)
    return str(path), state, stats


@task(name="recompute-close", retries=1, retry_delay_seconds=2, cache_policy=NONE)
def close_recompute_run(run: RecomputeRun) -> None:
    mlflow_runs.client(run.tracking_uri).set_terminated(run.run_id, "FINISHED")
