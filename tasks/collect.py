"""Stage 1: play the iteration's rollouts with the current policy and store them as Parquet.

The iteration's tasks are split into ``rollout.shards`` fixed shards (``horizonrl.rollout.loop.split_shards``),
each played by the ``collect-shard`` task: one after another in this process (``rollout.runner: local``;
a single local shard plays in the collect task itself) or in parallel on a Ray cluster through prefect-ray's
task runner (``ray``), where each Ray worker keeps its own player (policy and environments,
``tasks.context.shard_player``). The shards' records are joined in order, so the tables do not depend on
where the shards ran. A method that branches (APPO) has its branches planned over all initial rollouts and
played here, after the shards.

With ``rollout.max_staleness`` >= 1 (asynchronous rollouts, docs/algorithms.md §1.10) the train flow takes
its rollouts through ``Collects``, which submits this task ahead so it runs beside the update of the
iteration before, played by the run's generator (a second player with its own copy of the weights, loaded
from the checkpoint it is given) instead of the learner's player.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow.compute as pc
from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.futures import PrefectFuture

from horizonrl import faults, store
from horizonrl.files import file_digest
from horizonrl.rollout.asynchronous import AsyncSchedule
from horizonrl.rollout.loop import Shard, collect_seed, iteration_shards
from horizonrl.rollout.metrics import branch_metrics, episode_metrics
from horizonrl.rollout.records import EpisodeRecord
from horizonrl.run.player import Player, Serving
from horizonrl.tracking import mlflow_runs
from horizonrl.training.checkpoint import CheckpointRef, checkpoint_dir, checkpoints
from tasks.context import RunContext, owners, shard_player
from tasks.tracking import log_stage, set_run_tags, weight_sync_figures


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
    ref = RolloutRef(iteration, str(d / "episodes.parquet"), str(d / "turns.parquet"))
    if (d / "episodes.parquet").is_file() and (d / "turns.parquet").is_file():
        digests = {"turns": file_digest(ref.turns), "episodes": file_digest(ref.episodes)}
        _check_recorded(ctx, iteration, ref, digests)
        get_run_logger().info("iteration %d: rollouts already stored, reused", iteration)
        played = None
    else:
        if newest:
            policy = max([policy, *checkpoints(ctx.path)], key=lambda c: c.iteration)
        start, player = time.time(), owners(ctx).collector
        sync = player.sync(policy)  # a version boundary: before the first episode
        records = _play(ctx, iteration, policy, player)
        if cfg.rollout.max_staleness and sync is not None:  # the generator's server moved: logged at the
            # collect's iteration (a synchronous run's moves at the update's)
            log_stage(ctx, "collect", weight_sync_figures(ctx, iteration, sync), iteration)
        digests = _store(ctx, iteration, policy, records, ref)
        played = (start, time.time())
    episodes = store.read_table(ref.episodes, "episodes")
    version = int(episodes["policy_version"][0].as_py()) if episodes.num_rows else policy.iteration
    _log_collect(ctx, iteration, ref, episodes, digests)
    return RolloutRef(iteration, ref.episodes, ref.turns, version, played)


def _store(
    ctx: RunContext, iteration: int, policy: CheckpointRef, records: list[EpisodeRecord], ref: RolloutRef
) -> dict[str, str]:
    """Write the iteration's turns, then its episodes (the file that marks the rollouts complete); their digests."""
    digests = {"turns": store.write_table(store.turns_table(records, policy.iteration), ref.turns, "turns")}
    faults.kill_point("collect", iteration)
    table = store.episodes_table(records, ctx.cfg.run_name, iteration, policy.iteration)
    digests["episodes"] = store.write_table(table, ref.episodes, "episodes")
    return digests


def _log_collect(ctx: RunContext, iteration: int, ref: RolloutRef, episodes, digests: dict[str, str]) -> None:
    """The iteration's ``collect/*`` figures, computed from the stored tables, and the tables as the run's inputs."""
    metrics = episode_metrics(episodes)
    if ctx.cfg.preset.branches:
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
    uses. A worker's version boundary is its shard: it syncs its player to ``policy`` first."""
    player = shard_player(ctx)
    player.sync(policy, serving)
    return player.play(shard)


def _play(ctx: RunContext, iteration: int, policy: CheckpointRef, player: Player) -> list[EpisodeRecord]:
    """K rollouts of the iteration's tasks by ``player`` (synced to ``policy``), shard by shard; for a method
    that branches also the branches, planned over them and played in one batch in this process."""
    cfg = ctx.cfg
    pool = player.task_pool("train", cfg.env.train_pool)
    shards = iteration_shards(pool, cfg.rollout, cfg.seed, iteration)
    records = [r for part in _play_shards(ctx, policy, shards, player) for r in part]
    if cfg.preset.branches:  # played by the same checkpoint as their parents
        branches, stats = player.play_branches(records, collect_seed(cfg.seed, iteration))
        records += branches
        log_stage(ctx, f"collect/{cfg.method}", stats, iteration)
    return records


def _play_shards(
    ctx: RunContext, policy: CheckpointRef, shards: list[Shard], player: Player
) -> list[list[EpisodeRecord]]:
    """Each shard's records, in shard order. On Ray the run's cluster, joined at the run's start, runs them
    (the task runner only submits to it). One local shard is the collect task itself: it plays in it, without
    a task run of its own (one less per iteration for the API server)."""
    if ctx.cfg.rollout.runner == "local":
        return [player.play(shards[0])] if len(shards) == 1 else [play_shard(ctx, policy, s) for s in shards]
    from prefect_ray import RayTaskRunner  # the optional "ray" extra

    # vLLM: this process's server, synced to the policy by the collect, serves every shard (they never sync it)
    serving = player.serving() if player.serves_vllm else None
    with RayTaskRunner() as runner:  # Ray is already initialised: the runner neither starts nor stops it
        futures = [
            runner.submit(play_shard, {"ctx": ctx, "policy": policy, "shard": shard, "serving": serving})
            for shard in shards
        ]
        return [f.result() for f in futures]


class Collects:
    """Where the train flow takes each iteration's rollouts from: the collect task, played now by the current
    policy; or with asynchronous rollouts (``rollout.max_staleness`` = k >= 1) collect tasks submitted ahead
    of the update as ``horizonrl.rollout.asynchronous.AsyncSchedule`` says, played by the generator, with the
    run's ``async/*`` figures. With vLLM the generator is the run's server, synced at the start of each
    collect, before its first episode: no episode straddles two versions."""

    def __init__(self, ctx: RunContext) -> None:
        r = ctx.cfg.rollout
        self.ctx = ctx
        self.schedule = AsyncSchedule(r.max_staleness, ctx.cfg.iterations) if r.max_staleness else None
        self.newest = r.async_mode == "bounded"
        self.futures: dict[int, PrefectFuture] = {}
        if self.schedule is not None and self.newest:
            set_run_tags(
                ctx,
                {"async_mode": "bounded", "reproducible": "false: the generator plays whichever checkpoint is newest"},
            )

    def take(self, iteration: int, policy: CheckpointRef) -> RolloutRef:
        """The rollouts of ``iteration``: played now by ``policy``; asynchronous, every collect the bound allows
        submitted now, then this iteration's awaited (played by checkpoint max(iteration-1-k, 0), or with
        ``bounded`` that one or a newer one, whichever is newest when the task starts)."""
        if self.schedule is None:
            return collect_rollouts(self.ctx, iteration, policy)
        started = time.time()
        for j, version in self.schedule.due(iteration, policy.iteration):
            ref = CheckpointRef(str(checkpoint_dir(self.ctx.path, version)), version)
            before = [self.futures[j - 1]] if j - 1 in self.futures else []
            self.futures[j] = collect_rollouts.submit(self.ctx, j, ref, self.newest, wait_for=before)
        rollouts = self.futures[iteration].result()
        self.schedule.taken(iteration, started, rollouts.played)
        return rollouts

    def done(self, iteration: int, rollouts: RolloutRef, policy: CheckpointRef) -> None:
        """``iteration`` ended with checkpoint ``policy``: log its ``async/*`` figures (the rows' staleness
        against the checkpoint its update started from, the learner's waiting share, batches played and not
        yet used) and the generator's idle share of the iteration before."""
        if self.schedule is None:
            return
        queued = sum(f.state.is_completed() for j, f in self.futures.items() if j > iteration)
        for it, figures in self.schedule.done(iteration, rollouts.policy_version, policy.iteration, queued):
            log_stage(self.ctx, "async", figures, it)
        self.futures.pop(iteration, None)

    def settle(self) -> None:
        """Before an evaluation of an asynchronous vLLM run: let the collects in flight end, so that the run's
        one server plays one version at a time (the evaluation syncs it to the evaluated checkpoint, the next
        collect back to its own). The transformers generator has its own weights: nothing to wait for."""
        if self.schedule is not None and self.ctx.cfg.engine.name == "vllm":
            for f in self.futures.values():
                f.wait()

    def close(self) -> None:
        """Wait for collects still playing (a budget stopped the run early) and log the last iteration's
        generator figure."""
        for f in self.futures.values():
            f.wait()
        if self.schedule is not None:
            for it, figures in self.schedule.close():
                log_stage(self.ctx, "async", figures, it)
