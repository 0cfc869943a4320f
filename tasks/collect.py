"""Stage 1: play the iteration's rollouts with the current policy and store them as Parquet.

The iteration's tasks are split into ``rollout.shards`` fixed shards (``horizonrl.rollout.loop.split_shards``),
each played by the ``collect-shard`` task: one after another in this process (``rollout.runner: local``;
a single local shard plays in the collect task itself) or in parallel on a Ray cluster through prefect-ray's task runner
(``ray``), where each Ray worker keeps
its own policy and environments in its ``PLAYER``. The shards' records are joined in order, so the
tables do not depend on where the shards ran. A method that branches (APPO) has its branches planned over
all initial rollouts and played here, after the shards.

With ``rollout.max_staleness`` >= 1 (asynchronous rollouts, docs/algorithms.md §1.10) the train flow submits
this task so it runs beside the update of the iteration before, and it plays with the process's generator
(``tasks.context.GENERATOR``: a second player with its own copy of the weights, loaded from the checkpoint it
is given) instead of the learner's model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow.compute as pc
from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from horizonrl import faults, store
from horizonrl.files import file_digest
from horizonrl.rollout.loop import Shard, iteration_shards
from horizonrl.rollout.metrics import branch_metrics, episode_metrics
from horizonrl.rollout.records import EpisodeRecord
from horizonrl.run.player import Player, Serving
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointRef, checkpoints
from tasks.context import RunContext, player
from tasks.tracking import log_stage, weight_sync_figures


@dataclass(frozen=True)
class RolloutRef:
    iteration: int
    episodes: str  # path of episodes.parquet
    turns: str  # path of turns.parquet
    policy_version: int = -1  # the checkpoint that played the rows (episodes.policy_version)
    played: tuple[float, float] | None = None  # wall-clock (start, end) of playing them here; None: reused


@task(name="collect", retries=1, retry_delay_seconds=1, cache_policy=NONE)
def collect_rollouts(ctx: RunContext, iteration: int, policy: CheckpointRef, newest: bool = False) -> RolloutRef:
    """Rollout tables are immutable: if this iteration's are complete (after a crash), reuse them.

    No Prefect cache: completeness is read from the store itself (episodes.parquet is written last).
    ``newest`` (``rollout.async_mode: bounded``): play with the run's newest checkpoint if it is newer
    than ``policy``, the oldest the staleness bound allows.
    """
    cfg = ctx.cfg
    d = store.iteration_dir(cfg.data_dir, cfg.experiment, cfg.run_name, iteration)
    paths = (str(d / "episodes.parquet"), str(d / "turns.parquet"))
    played = None
    if (d / "episodes.parquet").is_file() and (d / "turns.parquet").is_file():
        ref = RolloutRef(iteration, *paths)
        digests = {"turns": file_digest(ref.turns), "episodes": file_digest(ref.episodes)}
        _check_recorded(ctx, iteration, ref, digests)
        get_run_logger().info("iteration %d: rollouts already stored, reused", iteration)
    else:
        if newest:
            policy = max([policy, *checkpoints(ctx.path)], key=lambda c: c.iteration)
        start, p = time.time(), player(cfg)
        sync = p.sync(cfg, policy)  # a version boundary: before the first episode
        records = _play(ctx, iteration, policy, p)
        if cfg.rollout.max_staleness and sync is not None:  # the generator's server moved: logged at the
            # collect's iteration (a synchronous run's moves at the update's)
            log_stage(ctx, "collect", weight_sync_figures(ctx, iteration, sync), iteration)
        digests = {"turns": store.write_table(store.turns_table(records, policy.iteration), paths[1], "turns")}
        faults.kill_point("collect", iteration)
        digests["episodes"] = store.write_table(
            store.episodes_table(records, cfg.run_name, iteration, policy.iteration), paths[0], "episodes"
        )
        played = (start, time.time())
    episodes = store.read_table(paths[0], "episodes")
    version = int(episodes["policy_version"][0].as_py()) if episodes.num_rows else policy.iteration
    ref = RolloutRef(iteration, *paths, version, played)
    metrics = episode_metrics(episodes)
    if cfg.preset.branches:
        metrics.update(branch_metrics(episodes))
    turns = store.read_table(ref.turns, "turns", columns=["gen_s", "env_s", "format_valid", "finished"])
    metrics.update(
        gen_s=float(pc.sum(turns["gen_s"]).as_py() or 0.0), env_s=float(pc.sum(turns["env_s"]).as_py() or 0.0)
    )
    if turns.num_rows:  # generation faults: no parsable action, or cut at the token budget
        metrics.update(
            format_invalid_rate=1.0 - float(pc.mean(turns["format_valid"].cast("float64")).as_py()),
            unfinished_action_rate=1.0 - float(pc.mean(turns["finished"].cast("float64")).as_py()),
        )
    inputs = {
        f"iter={iteration}/{name}": (path, digests[name])
        for name, path in (("turns", ref.turns), ("episodes", ref.episodes))
    }
    log_stage(ctx, "collect", metrics, iteration, inputs=inputs)
    get_run_logger().info(
        "iteration %d collect: success %.3f, mixed groups %.2f",
        iteration,
        metrics["success_rate"],
        metrics["mixed_group_fraction"],
    )
    return ref


def _check_recorded(ctx: RunContext, iteration: int, ref: RolloutRef, digests: dict[str, str]) -> None:
    """Stored rollouts are reused only as they were written: a file whose digest differs from the one the
    run recorded for it in MLflow (its dataset input) is named, never taken for the original."""
    recorded = mlflow_runs.recorded_digests(ctx.mlflow(), ctx.mlflow_run_id)
    for name, path in (("turns", ref.turns), ("episodes", ref.episodes)):
        want = recorded.get(f"iter={iteration}/{name}")
        if want is not None and not digests[name].startswith(want):
            raise store.StoreError(
                f"{path}: sha256 {digests[name][:12]}... differs from the digest recorded when it was written "
                f"({want[:12]}..., MLflow run {ctx.mlflow_run_id}); the file was changed since. Move iteration "
                f"{iteration}'s folder away to collect its rollouts again"
            )


@task(name="collect-shard", task_run_name="collect-shard-{shard.index}", cache_policy=NONE)
def play_shard(
    ctx: RunContext, policy: CheckpointRef, shard: Shard, serving: Serving | None = None
) -> list[EpisodeRecord]:
    """K rollouts of the shard's tasks with this process's policy and environments (a Ray worker keeps
    them between iterations and loads each new checkpoint from its path), or on the run's vLLM server
    (``serving``: synced by the run's process, shared by every shard)."""
    return _shard_records(ctx, policy, shard, serving)


def _shard_records(
    ctx: RunContext, policy: CheckpointRef, shard: Shard, serving: Serving | None = None
) -> list[EpisodeRecord]:
    """The shard task's body, apart so that Ray ships it by reference: cloudpickle sends a task's own
    function by value (its module attribute is the Task, not the function) together with the globals it
    uses, which would copy this process's players (model, optimizer, environments) into every shard. A
    worker's version boundary is its shard: it syncs its player to ``policy`` first."""
    p = player(ctx.cfg)
    p.sync(ctx.cfg, policy, serving)
    return p.play(ctx.cfg, shard, ctx.cfg.rollout.group_size)


def _play(ctx: RunContext, iteration: int, policy: CheckpointRef, p: Player) -> list[EpisodeRecord]:
    """K rollouts of the iteration's tasks by ``p`` (synced to ``policy``), shard by shard; for a method that
    branches also the branches, planned over them and played in one batch in this process."""
    cfg = ctx.cfg
    shards = iteration_shards(cfg, p.task_pool(cfg, "train", cfg.env.train_pool), iteration)
    records = [r for part in _play_shards(ctx, policy, shards, p) for r in part]
    if cfg.preset.branches:  # played by the same checkpoint as their parents
        branches, stats = p.play_branches(cfg, records, iteration)
        records += branches
        log_stage(ctx, f"collect/{cfg.method}", stats, iteration)
    return records


def _play_shards(ctx: RunContext, policy: CheckpointRef, shards: list[Shard], p: Player) -> list[list[EpisodeRecord]]:
    """Each shard's records, in shard order. On Ray the run's cluster, joined at the run's start, runs them
    (the task runner only submits to it). One local shard is the collect task itself: it plays in it, without
    a task run of its own (one less per iteration for the API server)."""
    if ctx.cfg.rollout.runner == "local":
        group = ctx.cfg.rollout.group_size
        return [p.play(ctx.cfg, shards[0], group)] if len(shards) == 1 else [play_shard(ctx, policy, s) for s in shards]
    from prefect_ray import RayTaskRunner  # the optional "ray" extra

    # vLLM: this process's server, synced to the policy by the collect, serves every shard (they never sync it)
    serving = p.serving() if ctx.cfg.engine.name == "vllm" else None
    with RayTaskRunner() as runner:  # Ray is already initialised: the runner neither starts nor stops it
        futures = [
            runner.submit(play_shard, {"ctx": ctx, "policy": policy, "shard": shard, "serving": serving})
            for shard in shards
        ]
        return [f.result() for f in futures]
