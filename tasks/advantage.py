"""Stage 2: compute the method's advantages over stored rollouts; write them next to the rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prefect import get_run_logger, task
from prefect.cache_policies import NONE

import methods
from horizonrl import faults, store
from horizonrl.checkpoint import CheckpointRef, read_estimator_state
from horizonrl.sequences import step_batch
from tasks.collect import RolloutRef
from tasks.context import RunContext
from tasks.tracking import log_stage


# Figures every estimator reports under the same name; the rest are logged as advantage/<method>/<name>.
SHARED_FIGURES = {"zero_group_fraction", "kept_fraction", "adv_mean", "adv_abs_mean", "groups", "trajectories"}


@dataclass(frozen=True)
class AdvantageRef:
    iteration: int
    table: str  # advantages-<method>.parquet
    state: str | None  # estimator state after this batch (JSON), None for stateless estimators


def compute_advantages(rollouts: RolloutRef, name: str, params: object, state_in: dict | None, update_index: int) -> tuple[pa.Table, dict | None, dict[str, float]]:
    """Run estimator ``name`` over one iteration's stored rollouts. Pure apart from reading Parquet.

    Episodes that ended in an environment error are left out of the estimate (their return says nothing
    about the policy, and counting them as failures would bias their group); their rows get advantage 0
    and ``keep=False``."""
    turns = store.read_table(rollouts.turns, "turns")
    episodes = store.read_table(rollouts.episodes, "episodes")
    errored = pc.is_in(turns["rollout_id"], value_set=episodes.filter(pc.equal(episodes["status"], "error"))["rollout_id"])
    left_out = turns.filter(errored)
    turns = turns.filter(pc.invert(errored))
    batch = step_batch(episodes, turns, update_index)
    entry = methods.ADVANTAGES.get(name)
    state = methods.state_from_json(name, state_in, params)
    result = entry.fn(batch, params, state)
    adv_tokens = None
    if result.adv_tokens is not None:
        ends = np.cumsum(batch.n_tokens)
        starts = ends - batch.n_tokens
        traj_first = np.r_[True, batch.traj_id[1:] != batch.traj_id[:-1]]
        # one flat list per trajectory, on its first row (index = the trajectory's action-token index)
        per_traj: dict[int, list[float]] = {}
        for n in range(len(batch)):
            per_traj.setdefault(int(batch.traj_id[n]), []).extend(result.adv_tokens[starts[n] : ends[n]].tolist())
        adv_tokens = [per_traj[int(t)] if first else None for t, first in zip(batch.traj_id, traj_first)]
    table = pa.table({
        "rollout_id": batch.traj_id, "turn": batch.turn.astype(np.int32), "adv": result.adv, "keep": result.keep,
        "adv_tokens": pa.array(adv_tokens if adv_tokens is not None else [None] * len(batch), type=pa.list_(pa.float64())),
    }, schema=store.ADVANTAGES)
    if left_out.num_rows:
        n = left_out.num_rows
        table = pa.concat_tables([table, pa.table({
            "rollout_id": left_out["rollout_id"], "turn": left_out["turn"], "adv": np.zeros(n), "keep": np.zeros(n, dtype=bool),
            "adv_tokens": pa.nulls(n, pa.list_(pa.float64())),
        }, schema=store.ADVANTAGES)])
    return table, methods.state_to_json(result.state), dict(result.stats)


@task(name="advantage", cache_policy=NONE)
def advantages(ctx: RunContext, iteration: int, rollouts: RolloutRef, policy: CheckpointRef) -> AdvantageRef:
    """Estimator state (BLPO memory) comes from the policy's checkpoint, so a resumed run computes
    bit-identical advantages. No Prefect cache: the computation is cheap and deterministic."""
    cfg = ctx.cfg
    name, params = cfg.advantage_spec()
    table, state, stats = compute_advantages(rollouts, name, params, read_estimator_state(policy), policy.iteration)
    d = Path(rollouts.turns).parent
    path = d / f"advantages-{cfg.method}.parquet"
    digest = store.write_table(table, path, "advantages")
    faults.kill_point("advantage", iteration)
    state_path = None
    if state is not None:
        state_path = d / f"estimator_state-{cfg.method}.json"
        store.write_json(state, state_path)
    kept = table["keep"].to_numpy(zero_copy_only=False)
    stats.setdefault("kept_fraction", float(kept.mean()) if len(kept) else 0.0)
    stats = {(k if k in SHARED_FIGURES else f"{cfg.method}/{k}"): v for k, v in stats.items()}
    log_stage(ctx, "advantage", stats, iteration, inputs={f"iter={iteration}/advantages-{cfg.method}": (str(path), digest)})
    get_run_logger().info("iteration %d advantage (%s): kept %.2f of rows", iteration, name, stats["kept_fraction"])
    return AdvantageRef(iteration, str(path), str(state_path) if state_path else None)


@task(name="recompute-advantage", cache_policy=NONE)
def recompute_iteration(iteration_dir: str, method: str, params: dict, state_in: dict | None) -> tuple[str, dict | None, dict[str, float]]:
    """Advantages of ``method`` over one stored iteration, written next to the original rollouts as
    ``advantages-<method>.parquet`` (other methods' tables are left alone). Returns (path, state, stats)."""
    from horizonrl.config import METHODS

    d = Path(iteration_dir)
    name = METHODS[method].advantage if method in METHODS else method
    entry = methods.ADVANTAGES.get(name)
    episodes = store.read_table(d / "episodes.parquet", "episodes", columns=["policy_version"])
    update_index = int(episodes["policy_version"][0].as_py()) if episodes.num_rows else 0
    ref = RolloutRef(-1, str(d / "episodes.parquet"), str(d / "turns.parquet"))
    table, state, stats = compute_advantages(ref, name, entry.params_cls(**params), state_in, update_index)
    path = d / f"advantages-{method}.parquet"
    store.write_table(table, path, "advantages")
    if state is not None:
        store.write_json(state, d / f"estimator_state-{method}.json")
    return str(path), state, stats
