"""A sweep's runs in MLflow: the parent run, its cells nested under it (tags), their metric histories for
the report, the page's context (with the prompted baselines' evaluation runs), and the best cell's
registration. The tasks of ``tasks/sweep.py`` call these; nothing here knows Prefect."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from horizonrl.config.sweep import Cell, load_sweep
from horizonrl.rollout.metrics import FAMILY_SUCCESS
from horizonrl.tracking import mlflow_runs, report, results_page
from horizonrl.tracking.stats import Interval
from mlflow import MlflowClient

HISTORIES = (
    "eval/success_rate",
    "eval/episodes",
    "collect/episodes",
    "collect/mean_turns",
    "collect/tokens_per_episode",
    "time/train_s",
    "time/env_steps",
)
PAIRED = ("eval/paired_change", "eval/paired_change_low", "eval/paired_change_high", "eval/paired_tasks")
FAMILY_PREFIX = f"eval/{FAMILY_SUCCESS}"  # then a task family: its held-out success
REPORT_TABLE = "report/comparison.json"  # pandas "split" JSON: {"columns": [...], "data": [[...], ...]}
CELL_TAG = "horizonrl.cell"  # the cell's coordinates as JSON; also one ``cell.<key>`` tag per coordinate
SWEEP_TAG = "horizonrl.sweep"
BASE_TAG = "horizonrl.sweep_base"  # the sweep file's name, shared by all its instances
INSTANCE_TAG = "horizonrl.instance"  # <scheduled time>-<commit> of a scheduled firing
PREVIOUS_TAG = "horizonrl.previous_instance"


def finished(c: MlflowClient, cell: Cell) -> bool:
    """The cell's run ended (FINISHED) after all its iterations (or its time or environment-step budget)."""
    run = mlflow_runs.find_run(c, cell.config.experiment, cell.run_name)
    return run is not None and ran_all(cell, run.info.status, run.data.metrics.get("summary/iterations", 0))


def ran_all(cell: Cell, status: str, iterations: float) -> bool:
    """A run of ``cell`` that ended with ``status`` after ``iterations`` needs no more: it finished all the
    cell's iterations, or stopped at its time or environment-step budget."""
    budgeted = cell.config.time_budget_s is not None or cell.config.env_step_budget is not None
    return status == "FINISHED" and (budgeted or iterations >= cell.config.iterations)


def link(c: MlflowClient, parent_id: str, sweep_name: str, cell: Cell, create: bool) -> None:
    """Nest the cell's run under the sweep's (MLflow's parentRunId tag) and tag its coordinates. The run is
    created when the cell starts (``create``), so its start time and duration in the UI are the cell's own,
    not the sweep's queue; the train flow then continues the run it finds by name."""
    coords = {f"cell.{k}": str(v) for k, v in cell.coords.items()}
    tags = {
        "mlflow.parentRunId": parent_id,
        SWEEP_TAG: sweep_name,
        CELL_TAG: json.dumps(cell.coords, sort_keys=True),
        **coords,
    }
    run = mlflow_runs.find_run(c, cell.config.experiment, cell.run_name)
    if run is not None:
        mlflow_runs.set_tags(c, run.info.run_id, tags)
    elif create:
        mlflow_runs.create_run(c, cell.config.experiment, cell.run_name, tags)


def link_tags(tags: dict[str, str]) -> dict[str, str]:
    """The tags of ``tags`` (a run's) that nest it under a sweep as one of its cells (``link``)."""
    return {k: v for k, v in tags.items() if k in ("mlflow.parentRunId", SWEEP_TAG, CELL_TAG) or k.startswith("cell.")}


def cell_runs(c: MlflowClient, parent_id: str) -> list[Any]:
    """Every cell run nested under ``parent_id`` (created ahead of starting, so a sweep's whole grid)."""
    exp_id = c.get_run(parent_id).info.experiment_id
    return c.search_runs(
        [exp_id],
        filter_string=f"tags.`mlflow.parentRunId` = {mlflow_runs.quoted(parent_id)}",
        order_by=["attributes.start_time ASC"],
    )


def unfinished(cell_runs: list[Any], expected: list[str]) -> list[str]:
    """Names of the sweep's cells that have not finished: its cell runs still running or killed, and the
    ``expected`` cell names (the sweep file's, when given) that have no run yet."""
    started = {r.info.run_name for r in cell_runs}
    return sorted(
        {r.info.run_name for r in cell_runs if r.info.status != "FINISHED"} | {n for n in expected if n not in started}
    )


def histories(c: MlflowClient, parent_id: str) -> dict[str, report.CellHistory]:
    """Run id -> the metric histories of every finished cell run nested under ``parent_id``; the variant
    is the cell's coordinates without its seed. A running or killed cell is left out: its last evaluation
    is not its final one."""
    out = {}
    for run in cell_runs(c, parent_id):
        if run.info.status != "FINISHED":
            continue
        coords = json.loads(run.data.tags.get(CELL_TAG, "{}"))
        variant = report.variant_name(coords)
        family_keys = sorted(key for key in run.data.metrics if key.startswith(FAMILY_PREFIX))
        paired_keys = [key for key in PAIRED if key in run.data.metrics]  # none in runs older than the figure
        h = {
            key: {m.step: m.value for m in c.get_metric_history(run.info.run_id, key)}
            for key in (*HISTORIES, *paired_keys, *family_keys)
        }
        train_s = h["time/train_s"][max(h["time/train_s"])] if h["time/train_s"] else float("nan")
        families = {key.removeprefix(FAMILY_PREFIX): h[key] for key in family_keys}
        out[run.info.run_id] = report.CellHistory(
            variant=variant,
            seed=int(run.data.tags.get("seed", coords.get("seed", 0))),
            success=h["eval/success_rate"],
            episodes=h["collect/episodes"],
            mean_turns=h["collect/mean_turns"],
            tokens_per_episode=h["collect/tokens_per_episode"],
            train_s=train_s,
            env_steps=h["time/env_steps"],
            wall_s=h["time/train_s"],
            families=families,
            eval_episodes=h["eval/episodes"],
            paired=_paired_at_last(h),
        )
    return out


def _paired_at_last(h: dict[str, dict[int, float]]) -> report.PairedChange | None:
    """The run's paired change (``PAIRED``) as logged at its last evaluation; None where it logged none
    there (a run older than the figure, or whose first evaluation stored no episodes)."""
    change, low, high, tasks = (h.get(key, {}) for key in PAIRED)
    success = h["eval/success_rate"]
    last = max(success, default=None)
    if last not in change:
        return None
    interval = Interval(change[last], low[last], high[last])
    return report.PairedChange(interval, int(tasks[last]), success[min(success)], success[last])


def baselines(c: MlflowClient, experiment: str) -> results_page.Baselines:
    """The prompted baselines of ``experiment``: its FINISHED evaluation runs of a model with no run behind
    it (``horizonrl evaluate --model``, tagged with the model's lineage), each as its params and metrics
    say; of runs with the same settings, the newest (a cell evaluated again replaces its row). An evaluation
    of a run's policy (``--source``, tagged with its source run) is not a baseline."""
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return results_page.Baselines(experiment, [], exists=False)
    runs = c.search_runs(
        [exp.experiment_id],
        filter_string="tags.`horizonrl.kind` = 'evaluation' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
    )
    out, seen = [], set()
    for run in runs:
        tags, p, m = run.data.tags, run.data.params, run.data.metrics
        if mlflow_runs.INIT_MODEL_TAG not in tags:
            continue
        tasks = p["eval.n_tasks_ends"] if p["eval.n_tasks_ends"] != "None" else p["eval.n_tasks"]  # tasks_at(end)
        mode = p["rollout.action_mode"]
        if mode == "free":  # what a free reply must look like is part of the setting
            mode = f"free ({p['rollout.free_format']})"
        row = results_page.Baseline(
            model=tags[mlflow_runs.INIT_MODEL_TAG],
            env=p["env.name"],
            tier=p["env.tier"],
            split=p["eval.split"],
            action_mode=mode,
            prompt=p["rollout.prompt"],
            context=p["rollout.context"],
            tasks=int(tasks),
            episodes=int(m["eval/episodes"]),
            success=m["eval/success_rate"],
            low=m["eval/success_ci_low"],
            high=m["eval/success_ci_high"],
            run_id=run.info.run_id,
        )
        setting = (row.model, row.env, row.tier, row.split, row.action_mode, row.prompt, row.context, row.tasks)
        if setting not in seen:
            seen.add(setting)
            out.append(row)
    return results_page.Baselines(experiment, out)


def previous_instance(c: MlflowClient, parent: Any) -> Any | None:
    """The newest finished instance of the same sweep that started before ``parent`` (None if not an instance)."""
    base = parent.data.tags.get(BASE_TAG)
    if INSTANCE_TAG not in parent.data.tags or base is None:
        return None
    runs = c.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{BASE_TAG}` = {mlflow_runs.quoted(base)} and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
    )
    earlier = [r for r in runs if INSTANCE_TAG in r.data.tags and r.info.start_time < parent.info.start_time]
    return earlier[0] if earlier else None


def page_context(
    c: MlflowClient,
    parent: Any,
    found: dict[str, report.CellHistory],
    sweep_path: str | None,
    out: str | None,
    previous: Any | None,
) -> results_page.PageContext:
    """What the page prints besides the numbers: commit, configs, warm start, the regenerate command."""
    nested = cell_runs(c, parent.info.run_id)
    runs = [r for r in nested if r.info.run_id in found]
    commits = sorted({commit for r in runs for commit in mlflow_runs.run_commits(r.data.tags) or ["unknown"]})
    instance = parent.data.tags.get(INSTANCE_TAG)
    configs, expected, tuning, prompted = [], [], None, None
    if sweep_path:
        spec, cells = load_sweep(sweep_path, instance)
        configs = [sweep_path, os.path.normpath(Path(sweep_path).parent / spec.base)]
        expected = [cell.run_name for cell in cells]
        tuning = spec.tuning
        prompted = baselines(c, spec.baselines) if spec.baselines else None
    warm = None
    sources = sorted(
        {
            (r.data.tags[mlflow_runs.INIT_MODEL_TAG], r.data.tags[mlflow_runs.INIT_SOURCE_TAG])
            for r in runs
            if mlflow_runs.INIT_SOURCE_TAG in r.data.tags
        }
    )
    if len(sources) == 1:
        model_uri, source = sources[0]
        h = {m.step: m.value for m in c.get_metric_history(source, "eval/success_rate")}
        n = {m.step: m.value for m in c.get_metric_history(source, "eval/episodes")}
        if h:
            warm = results_page.WarmStart(model_uri, source, h[max(h)], int(n.get(max(h), 0)))
    command = (
        f"horizonrl report {sweep_path or '<sweep file>'}"
        + (f" --instance {instance}" if instance else "")
        + (f" --out {out}" if out else "")
    )
    uri = c.tracking_uri
    before = list(histories(c, previous.info.run_id).values()) if previous is not None else []
    return results_page.PageContext(
        title=f"Results: {parent.info.run_name}",
        commits=commits,
        configs=configs,
        command=f"MLFLOW_TRACKING_URI={uri} {command}",
        tracking_uri=uri,
        parent_run_id=parent.info.run_id,
        warm_start=warm,
        previous=previous.info.run_name if previous is not None else None,
        previous_summaries=report.summarize(before) if before else [],
        unfinished=unfinished(nested, expected),
        code_changes=mlflow_runs.changed_code(commits),
        tuning=tuning,
        baselines=prompted,
    )


def log_comparison(c: MlflowClient, parent_id: str, rows: list[dict[str, Any]]) -> None:
    """The report's figures as metrics of the parent run, ``<variant>/<figure>`` (e.g. ``grpo/final_mean``):
    the parent's page lists them side by side in its Metrics table, and the experiment's chart view can
    plot them, without opening an artifact. Logged at step 0 and replaced by a rerun of the report."""
    figures = {}
    for row in rows:
        variant = re.sub(r"[^A-Za-z0-9_\-. /:]+", "_", str(row["variant"]))
        figures.update({f"{variant}/{k}": float(v) for k, v in row.items() if k != "variant"})
    mlflow_runs.log_metrics(c, parent_id, "compare", figures, 0)


def register_best(c: MlflowClient, parent_id: str, model_name: str) -> str:
    """Register the policy of the cell with the highest final held-out success (ties: larger AUC);
    returns the version (an existing one if this policy is already registered under the name)."""
    cells = histories(c, parent_id)
    run_id = max(cells, key=lambda r: (report.seed_figures(cells[r])["final"], report.seed_figures(cells[r])["auc"]))
    version = mlflow_runs.register_policy(c, run_id, model_name)
    mlflow_runs.set_tags(
        c, parent_id, {"horizonrl.best_run_id": run_id, "horizonrl.registered_model": f"{model_name}/{version}"}
    )
    return version
