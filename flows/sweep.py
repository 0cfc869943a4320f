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

import itertools
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from mlflow import MlflowClient
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from horizonrl import report, tracking
from horizonrl.config import TrainConfig, load_config

HISTORIES = ("eval/success_rate", "collect/episodes", "collect/mean_turns", "collect/tokens_per_episode", "time/train_s")
REPORT_TABLE = "report/comparison.json"  # pandas "split" JSON: {"columns": [...], "data": [[...], ...]}
CELL_TAG = "horizonrl.cell"  # the cell's coordinates as JSON; also one ``cell.<key>`` tag per coordinate
SWEEP_TAG = "horizonrl.sweep"
UNFINISHED = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]


class SweepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Parent run name and prefix of the cells' run names."""
    base: str
    """Train config the cells start from, relative to the sweep file."""
    set: list[str] = []
    """Overrides applied to every cell, ``key.sub=value``."""
    grid: dict[str, list[Any]]
    """Dotted config key -> values; the cells are the product of all lists."""
    deployment: str | None = None
    """``flow/deployment`` of ``train`` to fan cells out to; None runs them here, one after another."""
    concurrency: int = Field(1, ge=1)
    """Fanned-out cells in flight at once."""
    register_best: str | None = None
    """Register the best cell's policy under this model name (MLflow model registry)."""

    @field_validator("grid")
    @classmethod
    def _non_empty(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not grid:
            raise ValueError("grid is empty: give at least one key with a list of values, e.g. method: [loop, grpo]")
        for key, values in grid.items():
            if not values:
                raise ValueError(f"grid.{key} has no values")
        return grid


@dataclass(frozen=True)
class Cell:
    coords: dict[str, Any]
    config: TrainConfig

    @property
    def run_name(self) -> str:
        return self.config.run_name


def load_sweep(path: str | Path) -> tuple[SweepConfig, list[Cell]]:
    """Read and validate a sweep file and every cell's config before any work starts; errors name the
    file and the field (``grid``, ``grid.method``, or the cell and its config field)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"sweep file {str(p)!r} does not exist")
    try:
        spec = SweepConfig.model_validate(yaml.safe_load(p.read_text()) or {})
    except (yaml.YAMLError, ValidationError) as err:
        raise ValueError(f"sweep file {str(p)!r}: {err}") from err
    keys = list(spec.grid)
    cells = []
    for values in itertools.product(*spec.grid.values()):
        coords = dict(zip(keys, values))
        name = "--".join([spec.name, *(f"{k}={v}" for k, v in coords.items())])
        sets = [*spec.set, *(f"{k}={json.dumps(v)}" for k, v in coords.items()), f"run_name={json.dumps(name)}"]
        try:
            cells.append(Cell(coords, load_config(p.parent / spec.base, sets)))
        except ValueError as err:
            raise ValueError(f"sweep file {str(p)!r}, grid cell {coords}: {err}") from err
    for field in ("experiment", "tracking_uri"):
        if len({getattr(c.config, field) for c in cells}) > 1:
            raise ValueError(f"sweep file {str(p)!r}: grid varies {field!r}; a sweep's runs share one experiment and store")
    return spec, cells


def finished(c: MlflowClient, cell: Cell) -> bool:
    """The cell's run ended (FINISHED) after all its iterations (or its time budget)."""
    run = tracking.find_run(c, cell.config.experiment, cell.run_name)
    if run is None or run.info.status != "FINISHED":
        return False
    return cell.config.time_budget_s is not None or run.data.metrics.get("summary/iterations", 0) >= cell.config.iterations


@flow(name="sweep", log_prints=True)
def sweep(sweep_path: str, in_process: bool = False) -> list[dict[str, Any]]:
    """Run a sweep file's unfinished cells and report; returns the report's rows (one per variant).
    ``in_process`` runs the cells here even where the file names a deployment (no server at hand)."""
    log = get_run_logger()
    spec, cells = load_sweep(sweep_path)
    cfg0 = cells[0].config
    uri = tracking.tracking_uri(cfg0.tracking_uri)
    c = tracking.client(uri)
    parent_id, _ = tracking.find_or_create_run(c, cfg0.experiment, spec.name, {SWEEP_TAG: spec.name, "horizonrl.kind": "sweep"})
    tracking.set_tags(c, parent_id, {"git_commit": tracking.git_commit()})
    c.log_text(parent_id, Path(sweep_path).read_text(), "sweep.yaml")
    todo = [cell for cell in cells if not finished(c, cell)]
    deployment = None if in_process else spec.deployment
    log.info("sweep %s: %d cells, %d finished, %d to run (%s)", spec.name, len(cells), len(cells) - len(todo), len(todo), deployment or "in process")
    status = "FAILED"
    try:
        for cell in cells:
            _link(c, parent_id, spec.name, cell)
        states = _run_deployed(todo, deployment, spec.concurrency) if deployment else _run_here(todo)
        failed = {name: state for name, state in states.items() if state != "Completed"}
        for cell in (cell for cell in todo if cell.run_name in failed):
            run = tracking.find_run(c, cell.config.experiment, cell.run_name)
            if run is not None and run.info.status == "RUNNING":
                c.set_terminated(run.info.run_id, "FAILED")
        rows = sweep_report(spec.name, cfg0.experiment, uri)
        if spec.register_best:
            version = _register_best(c, parent_id, spec.register_best)
            log.info("best policy registered as %s version %s", spec.register_best, version)
        if failed:
            raise RuntimeError(f"sweep {spec.name}: cells did not complete: {failed}")
        status = "FINISHED"
    finally:
        c.set_terminated(parent_id, status)
    return rows


@flow(name="sweep-report", log_prints=True)
def sweep_report(sweep_name: str, experiment: str, tracking_uri: str | None = None) -> list[dict[str, Any]]:
    """Compare a sweep's cells from their MLflow metrics (``horizonrl.report``); log the table, a Markdown
    summary and the learning curves to the parent run, and publish table and summary as Prefect artifacts.
    Rerunning it replaces the parent's report files."""
    import matplotlib.pyplot as plt

    c = tracking.client(tracking.tracking_uri(tracking_uri))
    parent = tracking.find_run(c, experiment, sweep_name)
    if parent is None:
        raise ValueError(f"no sweep run named {sweep_name!r} in experiment {experiment!r}")
    cells = list(_histories(c, parent.info.run_id).values())
    if not cells:
        raise ValueError(f"sweep {sweep_name!r} has no cell runs under it yet")
    summaries = report.summarize(cells)
    rows, md = report.table(summaries), report.markdown(f"Sweep {sweep_name}", summaries)
    c.log_text(parent.info.run_id, pd.DataFrame(rows).to_json(orient="split", index=False), REPORT_TABLE)
    c.log_text(parent.info.run_id, md, "report/report.md")
    log_comparison(c, parent.info.run_id, rows)
    for x in ("iterations", "env_steps"):
        fig = report.plot(report.curves(cells), x)
        c.log_figure(parent.info.run_id, fig, f"report/success_vs_{x}.png")
        plt.close(fig)
    key = artifact_key(sweep_name)
    create_table_artifact(rows, key=f"{key}-report", description=f"Sweep {sweep_name}: held-out success per variant (mean, 95% CI over seeds)")
    create_markdown_artifact(md, key=f"{key}-summary", description=f"Sweep {sweep_name}: comparison")
    print(md)
    return rows


def log_comparison(c: MlflowClient, parent_id: str, rows: list[dict[str, Any]]) -> None:
    """The report's figures as metrics of the parent run, ``<variant>/<figure>`` (e.g. ``grpo/final_mean``):
    the parent's page lists them side by side in its Metrics table, and the experiment's chart view can
    plot them, without opening an artifact. Logged at step 0 and replaced by a rerun of the report."""
    figures = {}
    for row in rows:
        variant = re.sub(r"[^A-Za-z0-9_\-. /:]+", "_", str(row["variant"]))
        figures.update({f"{variant}/{k}": float(v) for k, v in row.items() if k != "variant"})
    tracking.log_metrics(c, parent_id, "compare", figures, 0)


def _run_here(cells: list[Cell]) -> dict[str, str]:
    """One child train flow after another; a failed cell does not stop the others."""
    from flows.train import train  # here, not at the top: a fanned-out sweep never needs the model stack (~10 s to import)

    states = {}
    for cell in cells:
        state = train.with_options(flow_run_name=cell.run_name)(config=cell.config.model_dump(), return_state=True)
        states[cell.run_name] = state.name
    return states


def _run_deployed(cells: list[Cell], deployment: str, concurrency: int, poll_s: float = 2.0) -> dict[str, str]:
    """Submit cells to the train deployment, at most ``concurrency`` in flight; return final state names.
    A cell whose flow run is still queued or running (an earlier attempt of this sweep) is waited for,
    not submitted again: two runs of one run name would write the same checkpoints."""
    pending, active, states = list(cells), {}, {}
    with get_client(sync_client=True) as client:
        while pending or active:
            while pending and len(active) < concurrency:
                cell = pending.pop(0)
                running = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[cell.run_name]), state=FlowRunFilterState(type=FlowRunFilterStateType(any_=UNFINISHED))))
                run = running[0] if running else run_deployment(deployment, parameters={"config": cell.config.model_dump()}, flow_run_name=cell.run_name, timeout=0)
                active[run.id] = cell
            time.sleep(poll_s)
            for run_id in list(active):
                state = client.read_flow_run(run_id).state
                if state is not None and state.is_final():
                    states[active.pop(run_id).run_name] = state.name
    return states


def _link(c: MlflowClient, parent_id: str, sweep_name: str, cell: Cell) -> None:
    """Nest the cell's run under the sweep's (MLflow's parentRunId tag) and tag its coordinates, creating
    the run if the cell has not started yet: the UI shows every cell under the sweep while it runs, and
    the train flow continues the run it finds by name."""
    coords = {f"cell.{k}": str(v) for k, v in cell.coords.items()}
    tags = {"mlflow.parentRunId": parent_id, SWEEP_TAG: sweep_name, CELL_TAG: json.dumps(cell.coords, sort_keys=True), **coords}
    run = tracking.find_run(c, cell.config.experiment, cell.run_name)
    if run is None:
        tracking.create_run(c, cell.config.experiment, cell.run_name, tags)
    else:
        tracking.set_tags(c, run.info.run_id, tags)


def artifact_key(name: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")


def _histories(c: MlflowClient, parent_id: str) -> dict[str, report.CellHistory]:
    """Run id -> the metric histories of every cell run nested under ``parent_id`` that has evaluated at
    least once; the variant is the cell's coordinates without its seed."""
    exp_id = c.get_run(parent_id).info.experiment_id
    runs = c.search_runs([exp_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'", order_by=["attributes.start_time ASC"])
    out = {}
    for run in runs:
        coords = json.loads(run.data.tags.get(CELL_TAG, "{}"))
        variant = " ".join(str(v) if k == "method" else f"{k}={v}" for k, v in coords.items() if k != "seed") or "base"
        h = {key: {m.step: m.value for m in c.get_metric_history(run.info.run_id, key)} for key in HISTORIES}
        if not h["eval/success_rate"]:
            continue  # a cell that has not started (its run is created ahead) has nothing to compare yet
        train_s = h["time/train_s"][max(h["time/train_s"])] if h["time/train_s"] else float("nan")
        out[run.info.run_id] = report.CellHistory(variant, int(run.data.tags.get("seed", coords.get("seed", 0))), h["eval/success_rate"],
                                                  h["collect/episodes"], h["collect/mean_turns"], h["collect/tokens_per_episode"], train_s)
    return out


def _register_best(c: MlflowClient, parent_id: str, model_name: str) -> str:
    """Register the policy of the cell with the highest final held-out success (ties: larger AUC);
    returns the version (an existing one if this policy is already registered under the name)."""
    cells = _histories(c, parent_id)
    run_id = max(cells, key=lambda r: (report.seed_figures(cells[r])["final"], report.seed_figures(cells[r])["auc"]))
    version = tracking.register_policy(c, run_id, model_name)
    tracking.set_tags(c, parent_id, {"horizonrl.best_run_id": run_id, "horizonrl.registered_model": f"{model_name}/{version}"})
    return version
