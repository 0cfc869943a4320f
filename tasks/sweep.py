"""The sweep's Prefect tasks: every write of a sweep to MLflow (its parent run, the cells nested under it,
the report, the best cell's registration) and the task that runs one cell on the train deployment."""

from __future__ import annotations

import asyncio
import re
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments import run_deployment
from prefect.flow_runs import wait_for_flow_run
from prefect.states import Crashed

from horizonrl.config import run_dir
from horizonrl.config.sweep import Cell, SweepConfig, load_sweep
from horizonrl.run import runlock
from horizonrl.tracking import (
    mlflow_runs,
    plots,
    report,
    results_page,
    study_compare,
    study_page,
    study_record,
    sweep_runs,
)

UNFINISHED = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]


class NothingToReport(ValueError):
    """No cell of the sweep has finished in this MLflow store (a study's may all be in its record)."""


@task(name="sweep-unfinished", cache_policy=NONE)
def unfinished_cells(cells: list[Cell], record: Path | None = None) -> list[Cell]:
    """The cells whose run has not ended after all its iterations (``sweep_runs.finished``): the ones to run.
    A study's committed ``record`` counts too: a cell it shows finished is not run again on a machine whose
    store lacks the run."""
    c = mlflow_runs.client(mlflow_runs.tracking_uri(cells[0].config.tracking_uri))
    recorded = study_record.finished_runs(record) if record is not None else {}
    todo = []
    for cell in cells:
        if sweep_runs.finished(c, cell):
            continue
        if cell.run_name in recorded and sweep_runs.ran_all(cell, "FINISHED", recorded[cell.run_name]):
            get_run_logger().info("cell %s: finished in the record %s, not run again", cell.run_name, record)
            continue
        todo.append(cell)
    return todo


def scheduled_instance() -> str:
    """The name of a scheduled firing's instance: when its flow run was scheduled to start (the same for every
    retry of it; now, outside a flow run) and the commit, so a rerun of the same flow run resumes it."""
    from prefect.runtime import flow_run

    when = flow_run.scheduled_start_time
    when = when.astimezone(UTC) if when is not None else datetime.now(UTC)
    return f"{when:%Y%m%dT%H%M%SZ}-{mlflow_runs.git_commit()[:8]}"


@dataclass(frozen=True)
class Link:
    """Where a starting cell's run is nested: the store and the sweep's parent run."""

    tracking_uri: str
    parent_id: str
    sweep_name: str


@task(name="sweep-open", cache_policy=NONE)
def open_sweep(spec: SweepConfig, name: str, instance: str | None, cells: list[Cell], sweep_path: str) -> Link:
    """The sweep's parent run (found or created, tagged with the commit, the sweep file logged), with the
    cells that started before nested under it."""
    cfg0 = cells[0].config
    uri = mlflow_runs.tracking_uri(cfg0.tracking_uri)
    c = mlflow_runs.client(uri)
    tags = {
        sweep_runs.SWEEP_TAG: name,
        "horizonrl.kind": "sweep",
        sweep_runs.BASE_TAG: spec.name,
        **({sweep_runs.INSTANCE_TAG: instance} if instance else {}),
    }
    parent_id, _ = mlflow_runs.find_or_create_run(c, cfg0.experiment, name, tags)
    mlflow_runs.set_tags(c, parent_id, {"git_commit": mlflow_runs.git_commit()})
    c.log_text(parent_id, Path(sweep_path).read_text(), "sweep.yaml")
    for cell in cells:
        sweep_runs.link(c, parent_id, name, cell, create=False)
    return Link(uri, parent_id, name)


@task(name="sweep-link-cell", task_run_name="link {cell.run_name}", cache_policy=NONE)
def link_cell(link: Link, cell: Cell) -> None:
    """Create the cell's run under the parent as the cell starts, so its start time in the UI is its own."""
    sweep_runs.link(mlflow_runs.client(link.tracking_uri), link.parent_id, link.sweep_name, cell, create=True)


@task(name="sweep-close", cache_policy=NONE)
def close_sweep(link: Link, failed_cells: list[Cell], status: str) -> None:
    """End the parent run with ``status``; a failed cell's run still marked RUNNING is marked FAILED."""
    c = mlflow_runs.client(link.tracking_uri)
    for cell in failed_cells:
        run = mlflow_runs.find_run(c, cell.config.experiment, cell.run_name)
        if run is not None and run.info.status == "RUNNING":
            c.set_terminated(run.info.run_id, "FAILED")
    c.set_terminated(link.parent_id, status)


@task(name="sweep-report-inputs", cache_policy=NONE)
def report_inputs(
    sweep_name: str, experiment: str, tracking_uri: str | None, sweep_path: str | None, out: str | None
) -> tuple[str, Any, list[report.CellHistory], results_page.PageContext]:
    """What the sweep's page is made of: (store, parent run, every finished cell's histories, the page's
    context: the sweep file, the previous instance)."""
    uri = mlflow_runs.tracking_uri(tracking_uri)
    c = mlflow_runs.client(uri)
    parent = mlflow_runs.find_run(c, experiment, sweep_name)
    if parent is None:
        raise ValueError(f"no sweep run named {sweep_name!r} in experiment {experiment!r}")
    found = sweep_runs.histories(c, parent.info.run_id)
    if not found:
        raise NothingToReport(f"sweep {sweep_name!r} has no finished cell runs under it yet")
    previous = sweep_runs.previous_instance(c, parent)
    return uri, parent, list(found.values()), sweep_runs.page_context(c, parent, found, sweep_path, out, previous)


@task(name="sweep-publish-report", cache_policy=NONE)
def publish_report(
    tracking_uri: str,
    parent: Any,
    cells: list[report.CellHistory],
    ctx: results_page.PageContext,
    out: str | None,
) -> list[dict[str, Any]]:
    """Log the page (``report/report.md``, the learning curves beside it), the table and the comparison
    metrics to the parent run; publish table, summary and, for an instance, the drift from the previous
    instance as Prefect artifacts; ``out`` also writes the page and its figures there. Rerunning it
    replaces the parent's report files with the same page."""
    c = mlflow_runs.client(tracking_uri)
    parent_id, sweep_name = parent.info.run_id, parent.info.run_name
    summaries = report.summarize(cells)
    pages = _write_pages(c, parent_id, cells, ctx, out)
    rows = report.table(summaries)
    c.log_text(parent_id, pd.DataFrame(rows).to_json(orient="split", index=False), sweep_runs.REPORT_TABLE)
    sweep_runs.log_comparison(c, parent_id, rows)
    key = artifact_key(sweep_name)
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
    if ctx.previous is not None:
        _publish_drift(c, parent, summaries, ctx)
    print(f"report: MLflow run {parent_id} ({sweep_name}), artifacts report/report.md and report/success_vs_*.png")
    if out is not None:
        print(f"page: {out}; figures: {', '.join(str(Path(out).parent / f) for f in pages['out'][1].values())}")
    return rows


def _write_pages(
    c: Any, parent_id: str, cells: list[report.CellHistory], ctx: results_page.PageContext, out: str | None
) -> dict[str, tuple[str, dict[str, str]]]:
    """The results page and its learning curves: to the parent run (``report/``) and, with ``out``, beside
    ``out``; returns {where: (page, {x axis: figure file})}."""
    import matplotlib.pyplot as plt

    curves = report.curves(cells)
    pages = {"report": ("report/report.md", {x: f"success_vs_{x}.png" for x in report.X_AXES})}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)  # its figures are written before the page
        pages["out"] = (out, {x: f"{Path(out).stem}_{x}.png" for x in report.X_AXES})
    for where, (page, figures) in pages.items():
        md = results_page.results_page(cells, ctx, figures)
        for x, name in figures.items():
            fig = plots.plot(curves, x)
            if where == "report":
                c.log_figure(parent_id, fig, f"report/{name}")
            else:
                fig.savefig(Path(out).parent / name, metadata={"Software": None})
            plt.close(fig)
        if where == "report":
            c.log_text(parent_id, md, page)
        else:
            Path(out).write_text(md)
    return pages


def _publish_drift(c: Any, parent: Any, summaries: list[report.VariantSummary], ctx: results_page.PageContext) -> None:
    """The variants whose final success left the previous instance's interval: an artifact and a tag."""
    sweep_name = parent.info.run_name
    drifted = report.drifts(summaries, ctx.previous_summaries)
    lines = [
        f"- **{d.variant}**: final success {d.now:.3f}, outside [{d.before.low:.3f}, {d.before.high:.3f}] "
        f"of {ctx.previous}"
        for d in drifted
    ]
    create_markdown_artifact(
        "\n".join(
            [f"# {sweep_name} against {ctx.previous}", "", *(lines or ["No variant left the previous interval."])]
        ),
        key=f"{artifact_key(parent.data.tags.get(sweep_runs.BASE_TAG, sweep_name))}-drift",
        description=f"Variants of {sweep_name} whose final success left {ctx.previous}'s interval",
    )
    mlflow_runs.set_tags(
        c,
        parent.info.run_id,
        {sweep_runs.PREVIOUS_TAG: ctx.previous, "horizonrl.drifted": ",".join(d.variant for d in drifted)},
    )


@task(name="sweep-publish-study", cache_policy=NONE)
def publish_study(tracking_uri: str, parent: Any, sweep_path: str) -> int:
    """The cells compared task by task, on the parent run: the study's record and page (``horizonrl study``)
    under ``study/``, and each pair of methods' pooled paired difference and verdict as
    ``compare/<a>-vs-<b>/...`` metrics beside the variants' figures. Returns how many figures it logged."""
    spec, cells = load_sweep(sweep_path, parent.data.tags.get(sweep_runs.INSTANCE_TAG))
    c, parent_id = mlflow_runs.client(tracking_uri), parent.info.run_id
    with tempfile.TemporaryDirectory() as tmp:
        record, out = Path(tmp) / "record", Path(tmp) / "page.md"
        study_record.export(cells, tracking_uri, record)
        study_page.write(record, out, study_page.meta(spec.name, sweep_path, "record", "page.md", spec.tuning))
        c.log_artifacts(parent_id, tmp, "study")
        outcomes, _, status = study_record.load(record)
    figures = study_compare.pair_figures(outcomes, status)
    mlflow_runs.log_metrics(c, parent_id, "compare", figures, 0)
    return len(figures)


@task(name="sweep-register-best", cache_policy=NONE)
def register_best(link: Link, model_name: str) -> str:
    """Register the best cell's policy under ``model_name``; returns the version."""
    return sweep_runs.register_best(mlflow_runs.client(link.tracking_uri), link.parent_id, model_name)


@task(name="sweep-cell", task_run_name="{cell.run_name}", cache_policy=NONE)
def run_cell(cell: Cell, deployment: str, link: Link, allow_change: list[str] | None = None) -> str:
    """Start the cell's flow run on the deployment and wait for it; return its final state's name. A flow run
    of this cell still queued or running (an earlier attempt of this sweep) is waited for, not submitted
    again: two runs of one run name would write the same checkpoints. One left RUNNING by a process that
    is gone (the machine or the stack stopped under it: no process holds the run's lock) is marked crashed
    and the cell submitted again; the new flow run resumes from the cell's last checkpoint. ``allow_change``:
    as ``train``'s, passed to the flow run."""
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
        link_cell(link, cell)
    run = (
        live[0]
        if live
        else run_deployment(
            deployment,
            parameters={"config": cell.config.model_dump(), "allow_change": allow_change or []},
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


def artifact_key(name: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
