"""Opening and closing a training run: MLflow run (found again by name), initial checkpoint, final model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.client.schemas.objects import FlowRun, State

from horizonrl import tracking
from horizonrl.store import remove_stale_temporaries
from horizonrl.checkpoint import CheckpointRef, latest_checkpoint, read_state, save_checkpoint
from horizonrl.config import CONFIG_FILE, TrainConfig, train_config
from horizonrl.models import load_policy
from tasks.context import RUNTIME, RunContext
from tasks.tracking import log_stage


@dataclass(frozen=True)
class RunStart:
    ctx: RunContext
    policy: CheckpointRef  # newest complete checkpoint (iteration 0 = initial weights)
    elapsed_s: float  # training wall time already spent by earlier attempts
    resumed: bool


@task(name="start-run", retries=1, retry_delay_seconds=2, cache_policy=NONE)
def start_run(cfg: TrainConfig) -> RunStart:
    """Resume after the last completed iteration if this run name has a checkpoint, else start fresh."""
    run_dir = Path(cfg.data_dir) / cfg.experiment / cfg.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    for p in remove_stale_temporaries(run_dir):
        get_run_logger().warning("removed a partial file left by an interrupted run: %s", p)
    uri = tracking.tracking_uri(cfg.tracking_uri)
    c = tracking.client(uri)
    tags = {"method": cfg.method, "env": cfg.env.name, "tier": cfg.env.tier, "seed": str(cfg.seed), "context": cfg.rollout.context,
            "git_commit": tracking.git_commit(), **tracking.lineage_tags(c, cfg.model.path)}
    run_id, resumed = tracking.find_or_create_run(c, cfg.experiment, cfg.run_name, tags)
    if resumed and not c.get_run(run_id).data.params:  # created ahead by a sweep, to nest it in the UI
        tracking.set_tags(c, run_id, tags)
        resumed = False
    if not resumed:
        tracking.log_params(c, run_id, cfg.flat())
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=True))
    c.log_artifact(run_id, str(run_dir / CONFIG_FILE))  # the run's config as it ran: the evaluate flow reloads it
    ctx = RunContext(cfg, str(run_dir), uri, run_id)
    policy = latest_checkpoint(run_dir)
    if policy is None:
        model, tokenizer = load_policy(RUNTIME.initial_model_dir(cfg))
        policy = save_checkpoint(run_dir, 0, model, tokenizer, None, {"nonfinite_steps": 0, "elapsed_s": 0.0, "mlflow_run_id": run_id, "seed": cfg.seed, "config_digest": cfg.digest()})
        RUNTIME.drop()
    state = read_state(policy)
    log_stage(ctx, "update", state.get("update_stats", {}), policy.iteration)  # if a crash came between checkpoint and log
    get_run_logger().info("run %s (MLflow %s): %s at iteration %d", cfg.run_name, run_id, "resumed" if policy.iteration else "starting", policy.iteration)
    return RunStart(ctx, policy, float(state.get("elapsed_s", 0.0)), resumed or policy.iteration > 0)


@task(name="finish-run", retries=1, retry_delay_seconds=2, cache_policy=NONE)
def finish_run(ctx: RunContext, policy: CheckpointRef) -> dict[str, float]:
    """Stop the environment workers and leave the Ray cluster; log the final policy as an MLflow model and
    the headline numbers; close the run."""
    import mlflow

    from horizonrl.policy_model import SIGNATURE, PolicyModel

    RUNTIME.close_episodes()
    RUNTIME.close_ray()
    c = ctx.mlflow()
    history = c.get_metric_history(ctx.mlflow_run_id, "eval/success_rate")
    by_step = {m.step: m.value for m in history}
    first, last = (by_step[min(by_step)], by_step[max(by_step)]) if by_step else (float("nan"), float("nan"))
    summary = {"initial_success_rate": first, "final_success_rate": last, "improvement": last - first, "iterations": float(policy.iteration)}
    tracking.log_metrics(c, ctx.mlflow_run_id, "summary", summary, policy.iteration)
    mlflow.set_tracking_uri(ctx.tracking_uri)
    with mlflow.start_run(run_id=ctx.mlflow_run_id):
        state_file = Path(policy.path) / "estimator_state.json"
        if state_file.is_file():  # BLPO memory: load with methods.state_from_json, inspect with .records()
            mlflow.log_artifact(str(state_file), artifact_path="estimator_state")
        mlflow.pyfunc.log_model(name="policy", python_model=PolicyModel(), artifacts={"policy": policy.path}, signature=SIGNATURE,
                                 pip_requirements=["torch", "transformers", "safetensors"])
    c.set_terminated(ctx.mlflow_run_id, "FINISHED")
    get_run_logger().info("run %s finished: held-out success %.3f -> %.3f", ctx.cfg.run_name, first, last)
    return summary


def end_failed_run(flow: object, flow_run: FlowRun, state: State) -> None:
    """Train flow hook (failure, crash): stop the environment workers and the Ray cluster, and mark the
    run FAILED in MLflow so the UI does not show a dead run as running. Running the same run name again
    resumes it (RUNNING again). A config too broken to name a run leaves nothing to mark."""
    RUNTIME.close_episodes()
    RUNTIME.close_ray()
    params = flow_run.parameters
    try:
        cfg = train_config(params.get("config_path"), params.get("overrides"), params.get("config"))
    except (ValueError, OSError):
        return
    c = tracking.client(tracking.tracking_uri(cfg.tracking_uri))
    run = tracking.find_run(c, cfg.experiment, cfg.run_name)
    if run is not None and run.info.status == "RUNNING":
        c.set_terminated(run.info.run_id, "FAILED")
        get_run_logger().warning("MLflow run %s (%s) marked FAILED: %s", run.info.run_id, cfg.run_name, state.message)
