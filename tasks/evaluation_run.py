"""An evaluation's MLflow run (``flows/evaluate.py``): its config, resolved from the source run or a config
file and checked before any run exists (``evaluation_config``, ``model_evaluation_config``, ``checked_policy``:
plain functions the command line also calls, so bad input is one line), and the tasks that plan, open and
close the run. An evaluation killed while it played in blocks is continued by the next one with the same
settings (``continued_evaluation``); one left RUNNING by a killed process is marked KILLED first.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from prefect import get_run_logger, task
from prefect.cache_policies import NONE

import mlflow
from horizonrl.config import (
    CONFIG_FILE,
    MODEL_URI_PREFIXES,
    TrainConfig,
    apply_overrides,
    load_config,
    override_keys,
    validated,
)
from horizonrl.envs import make_suite
from horizonrl.run import preflight
from horizonrl.run.learner import initial_model_dir
from horizonrl.tracking import mlflow_runs
from horizonrl.tracking.stats import wilson
from horizonrl.training.checkpoint import CheckpointRef
from mlflow import MlflowClient
from tasks.context import RunContext
from tasks.evaluate import block_files
from tasks.run import run_params

SOURCE_TAG = "horizonrl.source_run_id"
PROCESS_TAG = "horizonrl.process"  # <host>:<pid> of the process evaluating, to find a killed one later
CONTINUES_TAG = "horizonrl.continues_run_id"  # the unfinished evaluation whose stored blocks this one read
# What ``evaluate --set`` may change: where and how the policy plays, and where results go. The method,
# the update, the model and its training settings are the source's (the policy evaluated is its own).
EVAL_SETTABLE = (
    "env.",
    "eval.",
    "trace.",
    "engine.",
    "seed",
    "experiment",
    "data_dir",
    "tracking_uri",
    "model.device",
    "model.dtype",
    "model.attn_implementation",
    *(
        f"rollout.{f}"
        for f in (
            "temperature",
            "action_mode",
            "context",
            "history_turns",
            "max_action_tokens",
            "free_format",
            "prompt",
            "format_penalty",
            "enable_thinking",
            "env_workers",
            "step_timeout_s",
            "overlap",
        )
    ),
)


def evaluation_store(overrides: list[str] | None, tracking_uri: str | None = None) -> str:
    """The tracking store an evaluation finds its source in and logs its run to: ``--set tracking_uri=...``
    (read from ``overrides`` before any config), else ``tracking_uri`` (the flow's parameter), else
    $MLFLOW_TRACKING_URI or the default store. The two set apart are refused: one store per evaluation."""
    chosen = [item for item, key in zip(overrides or [], override_keys(overrides or [])) if key == "tracking_uri"]
    named = apply_overrides({}, chosen).get("tracking_uri")
    if named is not None and tracking_uri is not None and named != tracking_uri:
        raise ValueError(f"--set tracking_uri={named} and the flow's tracking_uri {tracking_uri}: give one store")
    return mlflow_runs.tracking_uri(named or tracking_uri, create=False)  # client() creates a new store


def evaluation_config(
    c: MlflowClient,
    source: str,
    split: str = "test",
    n_tasks: int | None = None,
    samples: int | None = None,
    overrides: list[str] | None = None,
) -> tuple[str, str, TrainConfig]:
    """(source run id, policy URI, config) of an evaluation: the source run's config with ``overrides``
    (``--set``, only ``EVAL_SETTABLE`` fields) and the split, task count and samples applied, validated as
    the train command validates its config, and the split checked against the suite's (which it builds:
    the user's games are checked too). Every problem is a one-line ``ValueError`` naming the field, so
    it is raised before any run is created."""
    overrides = list(overrides or [])
    for key in override_keys(overrides):
        if not any(key == f or (f.endswith(".") and key.startswith(f)) for f in EVAL_SETTABLE):
            raise ValueError(
                f"--set {key}: not a field evaluate can change (the policy, its method and training are the "
                f"source run's); allowed: {', '.join(f + '*' if f.endswith('.') else f for f in EVAL_SETTABLE)}"
            )
    source_run_id, model_uri = mlflow_runs.resolve_policy(c, source)
    raw = config_of_run(c, source_run_id).model_dump()
    apply_overrides(raw, overrides)
    return source_run_id, model_uri, _evaluation(c, raw, set(override_keys(overrides)), split, n_tasks, samples)


def model_evaluation_config(
    c: MlflowClient,
    model: str,
    config_path: str | None,
    split: str = "test",
    n_tasks: int | None = None,
    samples: int | None = None,
    overrides: list[str] | None = None,
) -> TrainConfig:
    """The config of evaluating ``model`` (``model.path``: a model folder, a pretrained model's name, or a
    logged policy) with no run behind it: ``config_path`` with ``overrides`` (any field: the config is the
    user's own) and the split, task count and samples applied, checked as ``evaluation_config`` checks its
    own. The run is named after the model."""
    if config_path is None:
        raise ValueError("--model needs --config: the environment, prompt and decoding to evaluate it with")
    keys = set(override_keys(overrides or []))
    if "model.path" in keys:
        raise ValueError("--set model.path: the model evaluated is --model")
    raw = load_config(config_path, overrides).model_dump()
    if raw["model"]["lora"] is not None:
        raise ValueError("model.lora: --model evaluates the model's own weights; fresh adapters do not apply")
    raw["model"]["path"] = model
    logged = model.startswith(MODEL_URI_PREFIXES)
    raw["run_name"] = model.partition(":/")[2].strip("/").replace("/", "-") if logged else Path(model).name
    return _evaluation(c, raw, keys, split, n_tasks, samples)


def _evaluation(
    c: MlflowClient, raw: dict[str, Any], keys: set[str], split: str, n_tasks: int | None, samples: int | None
) -> TrainConfig:
    """``raw`` (a config as a dict, ``--set`` keys ``keys`` applied) made an evaluation's: the split, task
    count and samples set, a run name with the time, validated, and the split checked against the suite's."""
    for flag, value in (("--n-tasks", n_tasks), ("--samples", samples)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if "eval.n_tasks" in keys and "eval.n_tasks_ends" not in keys:
        raw["eval"]["n_tasks_ends"] = None  # the tasks asked for, not the source's count at a run's ends
    raw["eval"]["split"] = split
    if n_tasks:
        raw["eval"].update(n_tasks=n_tasks, n_tasks_ends=None)
    if samples:
        raw["eval"]["samples"] = samples
    raw["run_name"] = f"{raw['run_name']}--eval-{split}-{time.strftime('%Y%m%dT%H%M%S')}"
    raw["tracking_uri"] = c.tracking_uri
    try:
        cfg = validated(raw)
    except ValueError as err:
        raise ValueError(one_line(err)) from err
    try:
        suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
        suite.tasks(split, cfg.env.tier, 1)
    except ValueError as err:
        raise ValueError(f"--split {split!r}: {one_line(err)}") from err
    return cfg


def checked_policy(cfg: TrainConfig, model_uri: str | None, split: str) -> CheckpointRef:
    """The policy of an evaluation: ``model_uri`` downloaded (``evaluation_config``), or with None the model
    of ``model.path`` (``model_evaluation_config``: a folder or a pretrained model, fetched on first use);
    checked with what it plays (``preflight``: its folder, the environment, the engine, and that its tokenizer
    tells the split's commands apart), so a policy that cannot play there is refused before the run exists."""
    if model_uri is None:
        suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
        policy = CheckpointRef(str(initial_model_dir(cfg, suite)), 0)
    else:
        policy = mlflow_runs.download_policy(model_uri, Path(cfg.data_dir) / "policies")
    preflight.check_run(cfg, policy.path)
    preflight.check_commands(cfg, policy.path, split)
    return policy


def one_line(err: Exception) -> str:
    """An error's message on one line (pydantic's spans several)."""
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


def mark_killed_evaluations(c: MlflowClient, experiment: str) -> list[str]:
    """Evaluation runs of ``experiment`` left RUNNING by a process of this host that no longer exists (it was
    killed: a killed process cannot mark its run), marked KILLED with the cause; returns their names."""
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    host, marked = socket.gethostname(), []
    for run in c.search_runs(
        [exp.experiment_id], filter_string="tags.`horizonrl.kind` = 'evaluation' and attributes.status = 'RUNNING'"
    ):
        where, _, pid = run.data.tags.get(PROCESS_TAG, "").rpartition(":")
        if where == host and pid.isdigit() and not psutil.pid_exists(int(pid)):
            cause = f"its process (pid {pid} on {host}) ended without reporting: killed; found by the next evaluate"
            mlflow_runs.set_tags(c, run.info.run_id, {mlflow_runs.FAILURE_TAG: cause})
            c.set_terminated(run.info.run_id, "KILLED")
            marked.append(run.info.run_name)
    return marked


def continued_evaluation(c: MlflowClient, cfg: TrainConfig, params: dict[str, str]) -> Run | None:
    """The newest evaluation run of ``cfg.experiment`` that ended unfinished (KILLED or FAILED) with these very
    ``params`` but its name, and left blocks of its evaluation stored (``eval.block_tasks``); None if there is
    none. The new evaluation takes its name, and so its folder, and plays only the blocks not stored."""
    exp = c.get_experiment_by_name(cfg.experiment)
    if exp is None or cfg.eval.block_tasks is None:
        return None
    mine = {k: v for k, v in params.items() if k != "run_name"}
    for run in c.search_runs(
        [exp.experiment_id], "tags.`horizonrl.kind` = 'evaluation'", order_by=["attributes.start_time DESC"]
    ):
        folder = Path(cfg.data_dir) / cfg.experiment / run.info.run_name
        if (
            run.info.status in ("KILLED", "FAILED")
            and {k: v for k, v in run.data.params.items() if k != "run_name"} == mine
            and any(block_files(d, "eval*") for d in folder.glob("iter=*"))
        ):
            return run
    return None


@dataclass(frozen=True)
class EvaluationPlan:
    """What an evaluation plays and where it is recorded, all checked before its run exists."""

    cfg: TrainConfig
    policy: CheckpointRef
    model_uri: str  # the policy's URI (a source run's) or the model evaluated (--model)
    source_run_id: str | None
    origin: dict[str, str]  # tags: the source run, or the model's lineage
    params: dict[str, str]


def evaluation_inputs(
    source: str | None,
    model: str | None,
    config_path: str | None,
    split: str = "test",
    n_tasks: int | None = None,
    samples: int | None = None,
    overrides: list[str] | None = None,
    tracking_uri: str | None = None,
) -> tuple[TrainConfig, CheckpointRef, str, str | None, MlflowClient]:
    """``source`` (a run id, ``runs:/<run id>`` or ``models:/<name>/<version>``) with its run's config, or
    ``model`` played as ``config_path`` says, checked: (the config, the policy (downloaded, checked), the model's
    URI, the source run's id, the store's client). Every problem is a one-line ``ValueError`` (the command line
    calls it before the flow; the flow's first task, with ``evaluation_plan``)."""
    if (source is None) == (model is None):
        raise ValueError("give a source run or model (--source), or a model with a config (--model)")
    if source is not None and config_path is not None:
        raise ValueError("--config goes with --model; a --source plays with its own run's config")
    uri = evaluation_store(overrides, tracking_uri)  # --set tracking_uri=... is where the source is and the run goes
    if source is not None and not mlflow_runs.store_exists(uri):
        raise ValueError(f"source {source!r}: the tracking store {uri} does not exist")
    c = mlflow_runs.client(uri)
    mlflow.set_tracking_uri(c.tracking_uri)  # the fluent API (logged models, downloads) reads the global URI
    if model is None:
        source_run_id, model_uri, cfg = evaluation_config(c, source, split, n_tasks, samples, overrides)
        return cfg, checked_policy(cfg, model_uri, split), model_uri, source_run_id, c
    cfg = model_evaluation_config(c, model, config_path, split, n_tasks, samples, overrides)
    return cfg, checked_policy(cfg, None, split), model, None, c


def evaluation_plan(
    cfg: TrainConfig, policy: CheckpointRef, model_uri: str, source_run_id: str | None, c: MlflowClient
) -> EvaluationPlan:
    """What ``evaluation_inputs`` checked, with the run's origin tags (the source run, or the model's lineage:
    its folder's digest, computed here once) and params."""
    if source_run_id is not None:
        origin = {SOURCE_TAG: source_run_id}
    else:
        origin = mlflow_runs.lineage_tags(c, model_uri, policy.path)
    suite = make_suite(cfg.env.name, cfg.env.suite_seed, cfg.env.games, cfg.data_dir)
    return EvaluationPlan(cfg, policy, model_uri, source_run_id, origin, run_params(cfg, suite, policy.path))


@task(name="evaluation-plan", cache_policy=NONE)
def plan_evaluation(
    source: str | None,
    model: str | None,
    config_path: str | None,
    split: str,
    n_tasks: int | None,
    samples: int | None,
    overrides: list[str] | None,
    tracking_uri: str | None,
) -> EvaluationPlan:
    """``evaluation_plan`` as the flow's first task. Not retried: its failures are the input's."""
    return evaluation_plan(
        *evaluation_inputs(source, model, config_path, split, n_tasks, samples, overrides, tracking_uri)
    )


@task(name="evaluation-open", cache_policy=NONE)
def open_evaluation(plan: EvaluationPlan) -> RunContext:
    """The evaluation's new MLflow run (tags: its origin, the policy's URI, this process), params logged; under
    the name, and so the folder, of an unfinished evaluation with the same params whose stored blocks it reads.
    Evaluations left RUNNING by a killed process of this host are marked KILLED first. Not retried: a retry
    would create a second run."""
    cfg, log = plan.cfg, get_run_logger()
    c = mlflow_runs.client(cfg.tracking_uri)
    for name in mark_killed_evaluations(c, cfg.experiment):
        log.warning("evaluation run %s was left RUNNING by a killed process; marked KILLED", name)
    params, origin = dict(plan.params), dict(plan.origin)
    earlier = continued_evaluation(c, cfg, params)
    if earlier is not None:  # its name, so its folder: the blocks it stored are read, not played again
        cfg = cfg.model_copy(update={"run_name": earlier.info.run_name})
        params["run_name"], origin[CONTINUES_TAG] = cfg.run_name, earlier.info.run_id
        log.info(
            "continuing evaluation run %s (%s): its stored blocks are not played again",
            cfg.run_name,
            earlier.info.status,
        )
    tags = {
        **origin,
        "horizonrl.kind": "evaluation",
        "horizonrl.policy_uri": plan.model_uri,
        PROCESS_TAG: f"{socket.gethostname()}:{os.getpid()}",
        "method": cfg.method,
        "env": cfg.env.name,
        "split": cfg.eval.split,
        "seed": str(cfg.seed),
    }
    run_id = mlflow_runs.create_run(c, cfg.experiment, cfg.run_name, tags)
    ctx = RunContext(cfg, str(Path(cfg.data_dir) / cfg.experiment / cfg.run_name), c.tracking_uri, run_id)
    try:
        mlflow_runs.log_params(c, run_id, params)
    except BaseException as err:
        fail_evaluation(ctx, err)
        raise
    return ctx


@task(name="evaluation-close", retries=1, retry_delay_seconds=2, cache_policy=NONE)
def close_evaluation(ctx: RunContext, iteration: int, metrics: dict[str, float]) -> dict[str, float]:
    """The success rate's 95% Wilson interval, logged (``eval/success_ci_low``, ``_high``); the run FINISHED."""
    low, high = wilson(metrics["success_rate"], int(metrics["episodes"]))
    c = ctx.mlflow()
    mlflow_runs.log_metrics(c, ctx.mlflow_run_id, "eval", {"success_ci_low": low, "success_ci_high": high}, iteration)
    c.set_terminated(ctx.mlflow_run_id, "FINISHED")
    return {"success_ci_low": low, "success_ci_high": high}


def fail_evaluation(ctx: RunContext, err: BaseException) -> None:
    """The run FAILED, with the cause (tag ``horizonrl.failure``): only a killed process leaves its run RUNNING.
    A plain call, not a task: it runs as the flow fails, a keyboard interrupt included."""
    c = ctx.mlflow()
    mlflow_runs.set_tags(c, ctx.mlflow_run_id, {mlflow_runs.FAILURE_TAG: one_line(err)[:4000] or type(err).__name__})
    c.set_terminated(ctx.mlflow_run_id, "FAILED")


def config_of_run(c: MlflowClient, run_id: str) -> TrainConfig:
    """The config run ``run_id`` ran with: its ``config.yaml`` artifact, logged when the run starts."""
    with tempfile.TemporaryDirectory() as tmp, mlflow_runs.no_progress_bar():  # one small file: no bar
        try:
            path = c.download_artifacts(run_id, CONFIG_FILE, tmp)
        except (MlflowException, OSError) as err:
            raise ValueError(
                f"run {run_id} has no {CONFIG_FILE} artifact (a train run logs it when it starts): {err}"
            ) from err
        return load_config(path)
