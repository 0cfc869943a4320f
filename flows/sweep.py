"""The ``sweep`` flow: every cell of a grid (methods x seeds x any overrides) as a child ``train`` run,
then the comparison report on the sweep's parent MLflow run.

    load the sweep file -> parent run -> run unfinished cells (in process, or fanned out to a work pool
    through the train deployment) -> link each cell's run under the parent -> report -> register the best

A sweep file (``configs/sweeps/``)::

    name: ablation              # parent run name; cell runs are <name>--method=loop--seed=0
    base: ../loop_household_easy.yaml   # train config, relative to the sweep file
    set: [iterations=20]        # overrides for every cell (``--set`` syntax)
    grid: {method: [loop, grpo], seed: [0, 1, 2], loss_params.eps: [0.1, 0.2]}
    deployment: train/train     # fan out to this deployment; omit to run cells in process
    concurrency: 2              # cells in flight at once when fanned out
    register_best: horizonrl-household   # registered model name for the best cell's policy (optional)

Rerunning a sweep skips finished cells; an unfinished one resumes, as ``train`` resumes per run name.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments import run_deployment
from prefect.flow_runs import wait_for_flow_run
from prefect.states import Crashed
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from horizonrl.config import TrainConfig, load_config, run_dir
from horizonrl.rollout.metrics import FAMILY_SUCCESS
from horizonrl.run import runlock
from horizonrl.tracking import mlflow_runs, plots, report, results_page
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
FAMILY_PREFIX = f"eval/{FAMILY_SUCCESS}"  # then a task family: its held-out success
REPORT_TABLE = "report/comparison.json"  # pandas "split" JSON: {"columns": [...], "data": [[...], ...]}
CELL_TAG = "horizonrl.cell"  # the cell's coordinates as JSON; also one ``cell.<key>`` tag per coordinate
SWEEP_TAG = "horizonrl.sweep"
BASE_TAG = "horizonrl.sweep_base"  # the sweep file's name, shared by all its instances
INSTANCE_TAG = "horizonrl.instance"  # <scheduled time>-<commit> of a scheduled firing
PREVIOUS_TAG = "horizonrl.previous_instance"
UNFINISHED = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]


class SweepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Parent run name and prefix of the cells' run names."""
    base: str
    """Train config the cells start from, relative to the sweep file."""
    set: list[str] = []
    """Overrides applied to every cell, ``key.sub=value``."""
    grid: dict[str, list[Any]] | list[dict[str, list[Any]]]
    """Dotted config key -> values; the cells are the product of all lists. A list of such grids is the
    union of their products (e.g. every method, plus one method's ablations)."""
    deployment: str | None = None
    """``flow/deployment`` of ``train`` to fan cells out to; None runs them here, one after another."""
    concurrency: int = Field(1, ge=1)
    """Fanned-out cells in flight at once."""
    register_best: str | None = None
    """Register the best cell's policy under this model name (MLflow model registry)."""
    tuning: str | None = None
    """What was tuned before the sweep, and on which methods: printed on the results page, since a
    comparison is only as fair as the tuning behind it."""

    @field_validator("grid")
    @classmethod
    def _non_empty(
        cls, grid: dict[str, list[Any]] | list[dict[str, list[Any]]]
    ) -> dict[str, list[Any]] | list[dict[str, list[Any]]]:
        for g in grid if isinstance(grid, list) else [grid]:
            if not g:
                raise ValueError(
                    "grid is empty: give at least one key with a list of values, e.g. method: [loop, grpo]"
                )
            for key, values in g.items():
                if not values:
                    raise ValueError(f"grid.{key} has no values")
        return grid

    def grids(self) -> list[dict[str, list[Any]]]:
        return self.grid if isinstance(self.grid, list) else [self.grid]


@dataclass(frozen=True)
class Cell:
    coords: dict[str, Any]
    config: TrainConfig

    @property
    def run_name(self) -> str:
        return self.config.run_name


def load_sweep(path: str | Path, instance: str | None = None) -> tuple[SweepConfig, list[Cell]]:
    """Read and validate a sweep file and every cell's config before any work starts; errors name the
    file and the field (``grid``, ``grid.method``, or the cell and its config field). An ``instance``
    (a scheduled firing) names the sweep and its cells ``<name>--<instance>...``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"sweep file {str(p)!r} does not exist")
    try:
        spec = SweepConfig.model_validate(yaml.safe_load(p.read_text()) or {})
    except (yaml.YAMLError, ValidationError) as err:
        raise ValueError(f"sweep file {str(p)!r}: {err}") from err
    if instance is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", instance):
        raise ValueError(f"sweep instance {instance!r}: use letters, digits, '_', '.' and '-' only")
    prefix = instance_name(spec.name, instance)
    cells = []
    for coords in (dict(zip(g, values)) for g in spec.grids() for values in itertools.product(*g.values())):
        name = "--".join([prefix, *(f"{k}={v}" for k, v in coords.items())])
        sets = [*spec.set, *(f"{k}={json.dumps(v)}" for k, v in coords.items()), f"run_name={json.dumps(name)}"]
        try:
            cells.append(Cell(coords, load_config(p.parent / spec.base, sets)))
        except ValueError as err:
            raise ValueError(f"sweep file {str(p)!r}, grid cell {coords}: {err}") from err
    duplicates = sorted({c.run_name for c in cells if sum(d.run_name == c.run_name for d in cells) > 1})
    if duplicates:
        raise ValueError(f"sweep file {str(p)!r}: the grids repeat cells {duplicates}")
    for field in ("experiment", "tracking_uri"):
        if len({getattr(c.config, field) for c in cells}) > 1:
            raise ValueError(
                f"sweep file {str(p)!r}: grid varies {field!r}; a sweep's runs share one experiment and store"
            )
    return spec, cells


def finished(c: MlflowClient, cell: Cell) -> bool:
    """The cell's run ended (FINISHED) after all its iterations (or its time or environment-step budget)."""
    run = mlflow_runs.find_run(c, cell.config.experiment, cell.run_name)
    if run is None or run.info.status != "FINISHED":
        return False
    budgeted = cell.config.time_budget_s is not None or cell.config.env_step_budget is not None
    return budgeted or run.data.metrics.get("summary/iterations", 0) >= cell.config.iterations


@flow(name="sweep", log_prints=True)
def sweep(
    sweep_path: str,
    in_process: bool = False,
    new_instance: bool = False,
    instance: str | None = None,
    out: str | None = None,
) -> list[dict[str, Any]]:
    """Run a sweep file's unfinished cells and report; returns the report's rows (one per variant).
    ``in_process`` runs the cells here even where the file names a deployment (no server at hand).
    ``new_instance`` (the scheduled deployment) makes this firing a new instance of the sweep, named by
    the flow run's scheduled time and the commit, so a rerun of the same flow run resumes the same one;
    ``instance`` resumes a named instance. ``out`` also writes the results page (``docs/results.md``)."""
    log = get_run_logger()
    if new_instance and instance is None:
        instance = f"{scheduled_time():%Y%m%dT%H%M%SZ}-{mlflow_runs.git_commit()[:8]}"
    spec, cells = load_sweep(sweep_path, instance)
    name = instance_name(spec.name, instance)
    cfg0 = cells[0].config
    uri = mlflow_runs.tracking_uri(cfg0.tracking_uri)
    c = mlflow_runs.client(uri)
    tags = {
        SWEEP_TAG: name,
        "horizonrl.kind": "sweep",
        BASE_TAG: spec.name,
        **({INSTANCE_TAG: instance} if instance else {}),
    }
    parent_id, _ = mlflow_runs.find_or_create_run(c, cfg0.experiment, name, tags)
    mlflow_runs.set_tags(c, parent_id, {"git_commit": mlflow_runs.git_commit()})
    c.log_text(parent_id, Path(sweep_path).read_text(), "sweep.yaml")
    todo = [cell for cell in cells if not finished(c, cell)]
    deployment = None if in_process else spec.deployment
    log.info(
        "sweep %s: %d cells, %d finished, %d to run (%s)",
        name,
        len(cells),
        len(cells) - len(todo),
        len(todo),
        deployment or "in process",
    )
    status = "FAILED"
    try:
        for cell in cells:
            _link(c, parent_id, name, cell, create=False)  # cells that have started before (this instance's)
        link = Link(uri, parent_id, name)
        states = _run_deployed(todo, deployment, spec.concurrency, link) if deployment else _run_here(todo, link)
        failed = {name: state for name, state in states.items() if state != "Completed"}
        for cell in (cell for cell in todo if cell.run_name in failed):
            run = mlflow_runs.find_run(c, cell.config.experiment, cell.run_name)
            if run is not None and run.info.status == "RUNNING":
                c.set_terminated(run.info.run_id, "FAILED")
        rows = sweep_report(name, cfg0.experiment, uri, sweep_path, out)
        if spec.register_best:
            version = _register_best(c, parent_id, spec.register_best)
            log.info("best policy registered as %s version %s", spec.register_best, version)
        if failed:
            raise RuntimeError(f"sweep {name}: cells did not complete: {failed}")
        status = "FINISHED"
    finally:
        c.set_terminated(parent_id, status)
    return rows


def instance_name(sweep_name: str, instance: str | None) -> str:
    """The parent run's name: the sweep's, or ``<sweep>--<instance>`` for an instance."""
    return sweep_name if instance is None else f"{sweep_name}--{instance}"


def scheduled_time() -> datetime:
    """When this flow run was scheduled to start (the same for every retry of it); now, outside a flow run."""
    from prefect.runtime import flow_run

    when = flow_run.scheduled_start_time
    return when.astimezone(UTC) if when is not None else datetime.now(UTC)


@flow(name="sweep-report", log_prints=True)
def sweep_report(
    sweep_name: str,
    experiment: str,
    tracking_uri: str | None = None,
    sweep_path: str | None = None,
    out: str | None = None,
) -> list[dict[str, Any]]:
    """Compare a sweep's cells from their MLflow metrics (``horizonrl.tracking.report``); log the table, the page
    (``report/report.md``, embedding the learning curves beside it) to the parent run, and publish table,
    summary and, for an instance, the comparison with the previous instance as Prefect artifacts. ``out``
    also writes the page and its figures there (``docs/results.md``, ``docs/results_<x>.png``). Rerunning
    it replaces the parent's report files and gives the same page."""
    import matplotlib.pyplot as plt

    c = mlflow_runs.client(mlflow_runs.tracking_uri(tracking_uri))
    parent = mlflow_runs.find_run(c, experiment, sweep_name)
    if parent is None:
        raise ValueError(f"no sweep run named {sweep_name!r} in experiment {experiment!r}")
    found = _histories(c, parent.info.run_id)
    if not found:
        raise ValueError(f"sweep {sweep_name!r} has no finished cell runs under it yet")
    cells = list(found.values())
    summaries = report.summarize(cells)
    previous = _previous_instance(c, parent)
    ctx = _page_context(c, parent, found, sweep_path, out, previous)
    key = artifact_key(sweep_name)
    curves = report.curves(cells)
    pages = {"report": ("report/report.md", {x: f"success_vs_{x}.png" for x in report.X_AXES})}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)  # its figures are written before the page
        stem = Path(out).stem
        pages["out"] = (out, {x: f"{stem}_{x}.png" for x in report.X_AXES})
    for where, (page, figures) in pages.items():
        md = results_page.results_page(cells, ctx, figures)
        for x, name in figures.items():
            fig = plots.plot(curves, x)
            if where == "report":
                c.log_figure(parent.info.run_id, fig, f"report/{name}")
            else:
                fig.savefig(Path(out).parent / name, metadata={"Software": None})
            plt.close(fig)
        if where == "report":
            c.log_text(parent.info.run_id, md, page)
        else:
            Path(out).write_text(md)
    rows = report.table(summaries)
    c.log_text(parent.info.run_id, pd.DataFrame(rows).to_json(orient="split", index=False), REPORT_TABLE)
    log_comparison(c, parent.info.run_id, rows)
    create_table_artifact(
        rows,
        key=f"{key}-report",
        description=f"Sweep {sweep_name}: held-out success per variant (mean, 95% bootstrap interval over seeds)",
    )
    create_markdown_artifact(
        results_page.markdown(f"Sweep {sweep_name}", summaries),
        key=f"{key}-summary",
        description=f"Sweep {sweep_name}: comparison",
    )
    if previous is not None:
        drifted = report.drifts(summaries, ctx.previous_summaries)
        lines = [
            f"- **{d.variant}**: final success {d.now:.3f}, outside [{d.before.low:.3f}, {d.before.high:.3f}] of {ctx.previous}"
            for d in drifted
        ]
        create_markdown_artifact(
            "\n".join(
                [f"# {sweep_name} against {ctx.previous}", "", *(lines or ["No variant left the previous interval."])]
            ),
            key=f"{artifact_key(parent.data.tags.get(BASE_TAG, sweep_name))}-drift",
            description=f"Variants of {sweep_name} whose final success left {ctx.previous}'s interval",
        )
        mlflow_runs.set_tags(
            c,
            parent.info.run_id,
            {PREVIOUS_TAG: ctx.previous, "horizonrl.drifted": ",".join(d.variant for d in drifted)},
        )
    print(
        f"report: MLflow run {parent.info.run_id} ({sweep_name}), artifacts report/report.md and report/success_vs_*.png"
    )
    if out is not None:
        print(f"page: {out}; figures: {', '.join(str(Path(out).parent / f) for f in pages['out'][1].values())}")
    return rows


def log_comparison(c: MlflowClient, parent_id: str, rows: list[dict[str, Any]]) -> None:
    """The report's figures as metrics of the parent run, ``<variant>/<figure>`` (e.g. ``grpo/final_mean``):
    the parent's page lists them side by side in its Metrics table, and the experiment's chart view can
    plot them, without opening an artifact. Logged at step 0 and replaced by a rerun of the report."""
    figures = {}
    for row in rows:
        variant = re.sub(r"[^A-Za-z0-9_\-. /:]+", "_", str(row["variant"]))
        figures.update({f"{variant}/{k}": float(v) for k, v in row.items() if k != "variant"})
    mlflow_runs.log_metrics(c, parent_id, "compare", figures, 0)


def _previous_instance(c: MlflowClient, parent: Any) -> Any | None:
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


def _page_context(
    c: MlflowClient,
    parent: Any,
    found: dict[str, report.CellHistory],
    sweep_path: str | None,
    out: str | None,
    previous: Any | None,
) -> results_page.PageContext:
    """What the page prints besides the numbers: commit, configs, warm start, the regenerate command."""
    cell_runs = _cell_runs(c, parent.info.run_id)
    runs = [r for r in cell_runs if r.info.run_id in found]
    commits = sorted({commit for r in runs for commit in mlflow_runs.run_commits(r.data.tags) or ["unknown"]})
    instance = parent.data.tags.get(INSTANCE_TAG)
    configs, expected, tuning = [], [], None
    if sweep_path:
        spec, cells = load_sweep(sweep_path, instance)
        configs = [sweep_path, os.path.normpath(Path(sweep_path).parent / spec.base)]
        expected = [cell.run_name for cell in cells]
        tuning = spec.tuning
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
    before = list(_histories(c, previous.info.run_id).values()) if previous is not None else []
    return results_page.PageContext(
        f"Results: {parent.info.run_name}",
        commits,
        configs,
        f"MLFLOW_TRACKING_URI={uri} {command}",
        uri,
        parent.info.run_id,
        warm,
        previous.info.run_name if previous is not None else None,
        report.summarize(before) if before else [],
        _unfinished(cell_runs, expected),
        mlflow_runs.changed_code(commits),
        tuning,
    )


@dataclass(frozen=True)
class Link:
    """Where a starting cell's run is nested: the store and the sweep's parent run."""

    tracking_uri: str
    parent_id: str
    sweep_name: str

    def cell(self, cell: Cell) -> None:
        _link(mlflow_runs.client(self.tracking_uri), self.parent_id, self.sweep_name, cell, create=True)


def _run_here(cells: list[Cell], link: Link) -> dict[str, str]:
    """One child train flow after another; a failed cell does not stop the others."""
    from flows.train import (
        train,
    )  # here, not at the top: a fanned-out sweep never needs the model stack (~10 s to import)

    states = {}
    for cell in cells:
        link.cell(cell)
        state = train.with_options(flow_run_name=cell.run_name)(config=cell.config.model_dump(), return_state=True)
        states[cell.run_name] = state.name
    return states


def _run_deployed(cells: list[Cell], deployment: str, concurrency: int, link: Link) -> dict[str, str]:
    """Run each cell as a flow run of the train deployment, at most ``concurrency`` at once: each cell is a
    ``sweep-cell`` task that waits for its flow run, on a thread-pool task runner of ``concurrency``
    workers; return final state names."""
    with ThreadPoolTaskRunner(max_workers=concurrency) as runner:
        futures = {
            cell.run_name: runner.submit(run_cell, {"cell": cell, "deployment": deployment, "link": link})
            for cell in cells
        }
        return {name: f.result() for name, f in futures.items()}


@task(name="sweep-cell", task_run_name="{cell.run_name}", cache_policy=NONE)
def run_cell(cell: Cell, deployment: str, link: Link) -> str:
    """Start the cell's flow run on the deployment and wait for it; return its final state's name. A flow run
    of this cell still queued or running (an earlier attempt of this sweep) is waited for, not submitted
    again: two runs of one run name would write the same checkpoints. One left RUNNING by a process that
    is gone (the machine or the stack stopped under it: no process holds the run's lock) is marked crashed
    and the cell submitted again; the new flow run resumes from the cell's last checkpoint."""
    with get_client(sync_client=True) as client:
        unfinished = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=[cell.run_name]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=UNFINISHED)),
            )
        )
        live = []
        for run in unfinished:
            if run.state_type == StateType.RUNNING and _abandoned(run, cell):
                client.set_flow_run_state(
                    run.id, Crashed(message="its process is gone (no process holds the run's lock)"), force=True
                )
                get_run_logger().warning(
                    "cell %s: flow run %s was left running by a process that is gone; marked crashed, resubmitting",
                    cell.run_name,
                    run.name,
                )
            else:
                live.append(run)
    if not live:
        link.cell(cell)
    run = (
        live[0]
        if live
        else run_deployment(
            deployment,
            parameters={"config": cell.config.model_dump()},
            flow_run_name=cell.run_name,
            timeout=0,
            as_subflow=False,
        )
    )
    return asyncio.run(wait_for_flow_run(run.id, timeout=None)).state.name


def _abandoned(run: FlowRun, cell: Cell, grace_s: float = 300) -> bool:
    """A RUNNING flow run whose process is gone: it started more than ``grace_s`` ago (a live train flow
    takes the run's lock within seconds of starting) and no process holds the cell's run lock."""
    started = run.start_time or run.expected_start_time
    old = started is not None and (datetime.now(UTC) - started).total_seconds() > grace_s
    return old and not runlock.held_elsewhere(run_dir(cell.config))


def _link(c: MlflowClient, parent_id: str, sweep_name: str, cell: Cell, create: bool) -> None:
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


def artifact_key(name: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


def _cell_runs(c: MlflowClient, parent_id: str) -> list[Any]:
    """Every cell run nested under ``parent_id`` (created ahead of starting, so a sweep's whole grid)."""
    exp_id = c.get_run(parent_id).info.experiment_id
    return c.search_runs(
        [exp_id],
        filter_string=f"tags.`mlflow.parentRunId` = {mlflow_runs.quoted(parent_id)}",
        order_by=["attributes.start_time ASC"],
    )


def _unfinished(cell_runs: list[Any], expected: list[str]) -> list[str]:
    """Names of the sweep's cells that have not finished: its cell runs still running or killed, and the
    ``expected`` cell names (the sweep file's, when given) that have no run yet."""
    started = {r.info.run_name for r in cell_runs}
    return sorted(
        {r.info.run_name for r in cell_runs if r.info.status != "FINISHED"} | {n for n in expected if n not in started}
    )


def _histories(c: MlflowClient, parent_id: str) -> dict[str, report.CellHistory]:
    """Run id -> the metric histories of every finished cell run nested under ``parent_id``; the variant
    is the cell's coordinates without its seed. A running or killed cell is left out: its last evaluation
    is not its final one."""
    out = {}
    for run in _cell_runs(c, parent_id):
        if run.info.status != "FINISHED":
            continue
        coords = json.loads(run.data.tags.get(CELL_TAG, "{}"))
        variant = report.variant_name(coords)
        family_keys = sorted(key for key in run.data.metrics if key.startswith(FAMILY_PREFIX))
        h = {
            key: {m.step: m.value for m in c.get_metric_history(run.info.run_id, key)}
            for key in (*HISTORIES, *family_keys)
        }
        train_s = h["time/train_s"][max(h["time/train_s"])] if h["time/train_s"] else float("nan")
        families = {key.removeprefix(FAMILY_PREFIX): h[key] for key in family_keys}
        out[run.info.run_id] = report.CellHistory(
            variant,
            int(run.data.tags.get("seed", coords.get("seed", 0))),
            h["eval/success_rate"],
            h["collect/episodes"],
            h["collect/mean_turns"],
            h["collect/tokens_per_episode"],
            train_s,
            h["time/env_steps"],
            h["time/train_s"],
            families,
            h["eval/episodes"],
        )
    return out


def _register_best(c: MlflowClient, parent_id: str, model_name: str) -> str:
    """Register the policy of the cell with the highest final held-out success (ties: larger AUC);
    returns the version (an existing one if this policy is already registered under the name)."""
    cells = _histories(c, parent_id)
    run_id = max(cells, key=lambda r: (report.seed_figures(cells[r])["final"], report.seed_figures(cells[r])["auc"]))
    version = mlflow_runs.register_policy(c, run_id, model_name)
    mlflow_runs.set_tags(
        c, parent_id, {"horizonrl.best_run_id": run_id, "horizonrl.registered_model": f"{model_name}/{version}"}
    )
    return version
