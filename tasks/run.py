"""Opening and closing a training run, one job a task: clean up after a killed process, verify the store,
open the MLflow run (found again by name), the starting policy (checkpoint 0 of a new run), and at the end
the final model and the run's close."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml
from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.client.schemas.objects import FlowRun, State
from prefect.settings import PREFECT_HOME

from horizonrl import store
from horizonrl.config import CONFIG_FILE, TrainConfig, run_dir, train_config
from horizonrl.envs import EnvSuite
from horizonrl.models.loading import in_memory
from horizonrl.models.tokenizers import describe_tokenizer
from horizonrl.rollout.loop import turn_horizon
from horizonrl.run import config_history, runlock
from horizonrl.run.learner import initial_model_dir
from horizonrl.store import StoreError, remove_stale_temporaries
from horizonrl.tracking import mlflow_runs, sweep_runs
from horizonrl.tracking.sweep_runs import PAIRED
from horizonrl.training.checkpoint import (
    CheckpointDamaged,
    CheckpointRef,
    read_state,
    resume_checkpoint,
    save_checkpoint,
)
from tasks.context import RunContext, close_owners, owners
from tasks.tracking import log_stage


@dataclass(frozen=True)
class Found:
    """What a run's folder holds at its start: the newest checkpoint that verifies (None: a new run)."""

    policy: CheckpointRef | None


@dataclass(frozen=True)
class RunStart:
    policy: CheckpointRef  # newest complete checkpoint (iteration 0 = initial weights)
    elapsed_s: float  # training wall time already spent by earlier attempts


@task(name="start-afresh", cache_policy=NONE)
def start_afresh(cfg: TrainConfig) -> None:
    """A start of this run that finished no iteration, run again with other settings (the corrected
    command after a failed start), is no resume: its files move to ``failed-starts/<n>/`` in the run folder
    and its MLflow run, renamed ``<run_name>.failed-start-<n>``, is marked FAILED naming what changed; a new
    MLflow run takes the name (with the old one's sweep links), so the run's params are the new settings'.
    Nothing for any other start. Called under the run folder's lock, before the store is verified
    (``verify_store``)."""
    d = run_dir(cfg)
    changes = config_history.failed_start(d, cfg)
    if not changes:
        return
    aside = config_history.set_aside(d)
    reason = (
        f"a start that finished no iteration, replaced by one with other settings ({'; '.join(map(str, changes))}); "
        f"its files are in {aside}"
    )
    c = mlflow_runs.client(mlflow_runs.tracking_uri(cfg.tracking_uri))  # the store open_run opens next
    old = mlflow_runs.find_run(c, cfg.experiment, cfg.run_name)
    new_name = f"{cfg.run_name}.failed-start-{aside.name}"
    if old is not None:
        mlflow_runs.supersede_run(c, old, new_name, reason, sweep_runs.link_tags(old.data.tags))
    get_run_logger().warning(
        "run %s starts afresh: %s%s",
        cfg.run_name,
        reason,
        f"; its MLflow run {old.info.run_id} is renamed {new_name}" if old is not None else "",
    )


@task(name="clean-up-killed", retries=1, retry_delay_seconds=2, cache_policy=NONE)
def clean_up_killed(killed_holder: dict[str, Any] | None) -> None:
    """After a process killed holding the run's lock (``killed_holder``: what it recorded): its Prefect flow
    run marked crashed; and temporary Prefect servers left by killed processes, of this run or another,
    stopped. Retried: it speaks to Prefect's API."""
    for pid in runlock.stop_orphaned_prefect_servers(PREFECT_HOME.value()):
        get_run_logger().warning(
            "stopped Prefect's temporary API server (pid %d) left running by a killed process", pid
        )
    if killed_holder:
        _mark_crashed(killed_holder)


@task(name="verify-store", cache_policy=NONE)
def verify_store(cfg: TrainConfig) -> Found:
    """The run folder as an earlier attempt left it: partial files removed, the newest checkpoint that verifies
    against its manifest found (a damaged newer one named and replayed). Called under the run folder's lock
    (``horizonrl.run.runlock``). Not retried: a damaged store stays damaged."""
    log, d = get_run_logger(), run_dir(cfg)
    for p in remove_stale_temporaries(d):
        log.warning("removed a partial file left by an interrupted run: %s", p)
    policy, damaged = resume_checkpoint(d)  # verified before anything is logged
    for ref, problem in damaged:
        log.warning("checkpoint %s fails verification: %s; it is not used", ref.path, problem)
    if damaged and policy is None:
        raise CheckpointDamaged(
            f"no checkpoint of run {cfg.run_name!r} verifies ({'; '.join(f'{r.path}: {p}' for r, p in damaged)}); "
            f"to start the run again from its initial weights, move {d / 'checkpoints'} away"
        )
    if damaged:
        log.warning(
            "falling back to checkpoint %s, the newest that verifies: iterations %d to %d are replayed from it "
            "(stored rollouts are reused, logged figures are not logged again)",
            policy.path,
            policy.iteration + 1,
            damaged[0][0].iteration,
        )
    return Found(policy)


@task(name="open-run", retries=1, retry_delay_seconds=2, cache_policy=NONE)
def open_run(
    cfg: TrainConfig,
    found: Found,
    changes: list[config_history.Change] | None = None,
    initial: str | None = None,
    kind: str | None = None,
) -> RunContext:
    """The run's MLflow run, found again by name or created (tagged, its params logged), with the stored
    rollouts of a resumed run checked against what it recorded, the settings a resume changes (``changes``,
    ``preflight.check_start``) recorded beside the run's config and in MLflow, and the run's current config
    logged. ``initial``: the model a new run starts from instead of ``model.path`` (its warm start's
    ``models:/`` URI), tagged as its lineage; ``kind``: tag ``horizonrl.kind`` (``warmstart``). Logs in one
    line where the run goes on and what a resume changes. Retried: it writes to the tracking store."""
    uri = mlflow_runs.tracking_uri(cfg.tracking_uri)
    c, d = mlflow_runs.client(uri), run_dir(cfg)
    tags = {**_run_tags(c, cfg, initial), **({"horizonrl.kind": kind} if kind else {})}
    mlflow_runs.check_artifact_store(c, cfg.experiment)  # a read-only or full disk: named, before the run is touched
    run_id, resumed = mlflow_runs.find_or_create_run(c, cfg.experiment, cfg.run_name, tags)
    if resumed and not c.get_run(run_id).data.params:  # created ahead by a sweep, to nest it in the UI
        mlflow_runs.set_tags(c, run_id, tags)
        resumed = False
    if resumed:
        check_finished_rollouts(c, run_id, cfg, found.policy)
        mlflow_runs.record_commit(c, run_id, tags["git_commit"])
    else:
        mlflow_runs.log_params(c, run_id, run_params(cfg, owners(d).suite))
    done = found.policy.iteration if found.policy is not None else 0
    if changes:  # before config.yaml is replaced: the history keeps the first start's config
        _record_changes(c, run_id, d, done + 1, changes)
    (d / CONFIG_FILE).write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=True))
    c.log_artifact(run_id, str(d / CONFIG_FILE))  # the run's current config: the evaluate flow reloads it
    get_run_logger().log(
        logging.WARNING if changes else logging.INFO,
        "run %s (MLflow %s): %s%s",
        cfg.run_name,
        run_id,
        f"resumes after iteration {done}" if done else "starts at iteration 1",
        f", with changed settings from iteration {done + 1} on: {'; '.join(map(str, changes))}" if changes else "",
    )
    return RunContext(cfg, str(d), uri, run_id)


def _run_tags(c: Any, cfg: TrainConfig, initial: str | None) -> dict[str, str]:
    """A train run's tags: method, environment, seed, context, the commit, and where its policy came from."""
    commit = mlflow_runs.git_commit()
    return {
        "method": cfg.method,
        "env": cfg.env.name,
        "tier": cfg.env.tier,
        "seed": str(cfg.seed),
        "context": cfg.rollout.context,
        "git_commit": commit,
        mlflow_runs.COMMITS_TAG: commit,
        **mlflow_runs.lineage_tags(c, initial or cfg.model.path),
    }


def _record_changes(c: Any, run_id: str, d: Path, start: int, changes: list[config_history.Change]) -> None:
    """The settings a resume changes from iteration ``start`` on: into the run's config history (an artifact
    beside its config in folder ``d``) and its tags."""
    history = config_history.record(d, config_history.current_config(d), changes, start)
    mlflow_runs.set_tags(c, run_id, config_history.tags(history))
    c.log_artifact(run_id, str(history))


@task(name="starting-policy", retries=1, retry_delay_seconds=2, cache_policy=NONE)
def starting_policy(ctx: RunContext, found: Found, initial: str | None = None) -> RunStart:
    """The policy the run goes on from: the checkpoint found, or for a new run its initial weights (``initial``,
    else ``model.path`` or the tiny model) written as checkpoint 0 and handed to the learner, which plays it
    without reading it back. Logs the checkpoint's update figures if a crash came between checkpoint and log.
    Retried: loading a model can read from the network (a hub id, a logged policy)."""
    cfg, policy = ctx.cfg, found.policy
    if policy is None:
        run = owners(ctx)
        start = cfg.model.model_copy(update={"path": initial}) if initial is not None else cfg.model
        model, tokenizer = run.learner.weights.load(
            initial_model_dir(cfg.model_copy(update={"model": start}), run.suite)
        )
        in_memory(model)  # the run plays its own checkpoint 0, not the folder it came from (changed or not)
        state = {"nonfinite_steps": 0, "elapsed_s": 0.0, "mlflow_run_id": ctx.mlflow_run_id, "seed": cfg.seed}
        policy = save_checkpoint(ctx.path, 0, model, tokenizer, None, {**state, "config_digest": cfg.digest()})
        run.learner.weights.keep(policy, model, tokenizer)
    state = read_state(policy)
    log_stage(ctx, "update", state.get("update_stats", {}), policy.iteration)
    return RunStart(policy, float(state.get("elapsed_s", 0.0)))


def check_finished_rollouts(c: Any, run_id: str, cfg: TrainConfig, policy: CheckpointRef | None) -> None:
    """Every rollout file the run recorded (its MLflow dataset inputs) for an iteration its newest checkpoint
    has finished must still be there: a deleted one cannot be collected again as it was without replaying
    the run from before it, so the run stops naming what was lost and how to recover, rather than go on
    with a store that lacks it (``StoreError``)."""
    done = policy.iteration if policy is not None else 0
    missing = []
    for name, digest in sorted(mlflow_runs.recorded_digests(c, run_id).items()):
        folder, _, table = name.partition("/")
        if not folder.startswith("iter=") or not folder[5:].isdigit() or not 1 <= int(folder[5:]) <= done:
            continue
        path = store.iteration_dir(cfg.data_dir, cfg.experiment, cfg.run_name, int(folder[5:])) / f"{table}.parquet"
        if not path.is_file():
            missing.append(f"{path} (sha256 {digest[:12]}...)")
    if missing:
        raise StoreError(
            f"run {cfg.run_name!r}: stored rollouts of finished iterations are missing: {'; '.join(missing)}. "
            f"Restore them (the digests are recorded in MLflow run {run_id}), or move {run_dir(cfg)} away "
            "to start the run over"
        )


def run_params(cfg: TrainConfig, suite: EnvSuite, policy_dir: str | Path | None = None) -> dict[str, str]:
    """A run's MLflow params: its config, plus what the config leaves to the code, so the params are true
    to the run: ``env.horizon``, the turn horizon episodes are cut at (``env.max_turns`` or ``suite``'s
    for the tier), and with a model folder (``model.path``, or ``policy_dir``: the policy evaluated) the
    tokenizer that folder holds as ``model.tokenizer`` instead of the unused tiny-model setting."""
    params = cfg.flat()
    params["env.horizon"] = str(turn_horizon(cfg.env, suite))
    if policy_dir is None and cfg.model.path is not None:
        policy_dir = initial_model_dir(cfg, suite)
    if policy_dir is not None:
        params["model.tokenizer"] = describe_tokenizer(policy_dir)
    return params


def _mark_crashed(holder: dict[str, Any]) -> None:
    """Mark the Prefect flow run of a process that died holding the run's lock as crashed, if its
    state still says it runs (a SIGKILLed process reports nothing)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Crashed

    flow_run_id = holder.get("flow_run_id")
    if not flow_run_id:
        return
    with get_client(sync_client=True) as client:
        try:
            flow_run = client.read_flow_run(UUID(flow_run_id))
        except ObjectNotFound:  # recorded by another Prefect API
            return
        if flow_run.state is not None and not flow_run.state.is_final():
            client.set_flow_run_state(
                flow_run.id,
                Crashed(
                    message=f"the process ({runlock.describe(holder)}) ended without reporting; found by the next run"
                ),
                force=True,
            )
            get_run_logger().warning(
                "marked flow run %s (%s) crashed: its process, %s, was killed",
                flow_run.name,
                flow_run_id,
                runlock.describe(holder),
            )


@task(name="finish-run", retries=1, retry_delay_seconds=2, cache_policy=NONE)
def finish_run(ctx: RunContext, policy: CheckpointRef) -> dict[str, float]:
    """Log the final policy as an MLflow model and the headline numbers; close the run, then its owners
    (environment workers, vLLM server, update ranks, Ray cluster). A failure before the close leaves them
    to the retry, and then to the flow's failure hook (``end_failed_run``)."""
    c = ctx.mlflow()
    by_step = {m.step: m.value for m in c.get_metric_history(ctx.mlflow_run_id, "eval/success_rate")}
    first, last = (by_step[min(by_step)], by_step[max(by_step)]) if by_step else (float("nan"), float("nan"))
    summary = {"iterations": float(policy.iteration)}
    if by_step:  # a recipe's warm start evaluates nothing (``warmstart.before_rl``): no NaN figures
        summary |= {"initial_success_rate": first, "final_success_rate": last, "improvement": last - first}
    log_stage(ctx, "summary", summary, policy.iteration)  # once: a finished run run again logs nothing twice
    for key in PAIRED if by_step else ():  # the change paired by held-out task, for the command's summary
        at_last = [m.value for m in c.get_metric_history(ctx.mlflow_run_id, key) if m.step == max(by_step)]
        if at_last:
            summary[key.removeprefix("eval/")] = at_last[0]
    _log_final_policy(ctx, policy)
    c.set_terminated(ctx.mlflow_run_id, "FINISHED")
    close_owners(ctx.run_dir)
    get_run_logger().info("run %s finished: held-out success %.3f -> %.3f", ctx.cfg.run_name, first, last)
    return summary


def _log_final_policy(ctx: RunContext, policy: CheckpointRef) -> None:
    """The final policy as the run's MLflow model ``policy`` (once), with its estimator state, its prompt and
    decoding settings, and an input example."""
    c = ctx.mlflow()
    logged = mlflow_runs.policy_models(c, ctx.mlflow_run_id)
    if any(
        m.name == "policy" and m.tags.get(mlflow_runs.POLICY_ITERATION_TAG) == str(policy.iteration) for m in logged
    ):
        return
    state_file = Path(policy.path) / "estimator_state.json"
    if state_file.is_file():  # BLPO memory: load with methods.state_from_json, inspect with .records()
        c.log_artifact(ctx.mlflow_run_id, str(state_file), artifact_path="estimator_state")
    r = ctx.cfg.rollout
    decoding = {
        "prompt": r.prompt,
        "free_format": r.free_format,
        "enable_thinking": r.enable_thinking,
        "action_mode": r.action_mode,
        "max_action_tokens": r.max_action_tokens,
    }
    example = policy_example(owners(ctx).suite, ctx.cfg.eval.split, ctx.cfg.env.tier)
    mlflow_runs.log_policy(c, ctx.mlflow_run_id, policy.path, policy.iteration, decoding, example)


def policy_example(suite: EnvSuite, split: str, tier: str) -> dict[str, object]:
    """One input row of the run's logged policy (its input example, checked against its signature): the
    first turn of the first task of ``split`` at ``tier`` (the held-out one), as the policy was prompted."""
    env = suite.make()
    try:
        observation, info = env.reset(suite.tasks(split, tier, 1)[0])
    finally:
        env.close()
    return {"goal": info.get("goal", ""), "observation": observation, "admissible": list(info["admissible_commands"])}


def end_failed_run(flow: object, flow_run: FlowRun, state: State) -> None:
    """Train flow hook (failure, crash): close the run's owners (environment workers, vLLM server, update
    ranks, Ray cluster), and mark the run FAILED in MLflow with the cause (tag ``horizonrl.failure``) so the
    UI does not show a dead run as running. Running the same run name again resumes it (RUNNING again). A
    config too broken to name a run leaves nothing to close or mark."""
    params = flow_run.parameters
    try:
        cfg = train_config(params.get("config_path"), params.get("overrides"), params.get("config"), read_files=False)
    except (ValueError, OSError):
        return
    if runlock.held_elsewhere(run_dir(cfg)):  # refused because another process runs it: not ours to close or mark
        return
    close_owners(run_dir(cfg))
    uri = mlflow_runs.tracking_uri(cfg.tracking_uri)
    if not mlflow_runs.store_exists(uri):
        return  # stopped before its store was created: nothing to mark, and no store to create now
    c = mlflow_runs.client(uri)
    run = mlflow_runs.find_run(c, cfg.experiment, cfg.run_name)
    # FAILED already: MLflow's own ``start_run`` block (the final model's upload) marks it when it fails
    if run is not None and run.info.status in ("RUNNING", "FAILED"):
        mlflow_runs.set_tags(c, run.info.run_id, {mlflow_runs.FAILURE_TAG: (state.message or "")[:4000]})
        c.set_terminated(run.info.run_id, "FAILED")
        get_run_logger().warning("MLflow run %s (%s) marked FAILED: %s", run.info.run_id, cfg.run_name, state.message)
