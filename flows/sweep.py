"""The ``sweep`` flow: every cell of a grid (methods x seeds x any overrides, ``horizonrl/config/sweep.py``)
as a child ``train`` run, then the comparison report on the sweep's parent MLflow run.

    load the sweep file -> parent run -> run unfinished cells (in process, or fanned out to a work pool
    through the train deployment) -> link each cell's run under the parent -> report -> register the best

Rerunning a sweep skips finished cells (in the MLflow store, or in the study record the file names); an
unfinished one resumes, as ``train`` resumes per run name.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from horizonrl.config.sweep import Cell, instance_name, load_sweep
from horizonrl.run import preflight
from tasks.sweep import (
    Link,
    NothingToReport,
    close_sweep,
    link_cell,
    open_sweep,
    publish_report,
    publish_study,
    register_best,
    report_inputs,
    run_cell,
    scheduled_instance,
    unfinished_cells,
)


@flow(name="sweep", log_prints=True)
def sweep(
    sweep_path: str,
    in_process: bool = False,
    new_instance: bool = False,
    instance: str | None = None,
    out: str | None = None,
    allow_change: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Run a sweep file's unfinished cells and report; returns the report's rows (one per variant).
    ``in_process`` runs the cells here even where the file names a deployment (no server at hand).
    ``new_instance`` (the scheduled deployment) makes this firing a new instance of the sweep, named by
    the flow run's scheduled time and the commit, so a rerun of the same flow run resumes the same one;
    ``instance`` resumes a named instance. ``out`` also writes the results page (``docs/results.md``).
    ``allow_change``: fields every resumed cell may change, as ``train``'s (recorded in each cell's run)."""
    log = get_run_logger()
    if new_instance and instance is None:
        instance = scheduled_instance()
    spec, cells = load_sweep(sweep_path, instance)  # 1. every cell's config checked before any work
    name = instance_name(spec.name, instance)
    todo = unfinished_cells(cells, spec.record_folder(sweep_path))  # the store's, and a study record's
    for cell in todo:  # and what each brings (model, environment, engine) before the first starts
        preflight.check_start(cell.config, allow_change or [])
    deployment = None if in_process else spec.deployment
    log.info(
        "sweep %s: %d cells, %d finished, %d to run (%s)",
        name, len(cells), len(cells) - len(todo), len(todo), deployment or "in process",
    )  # fmt: skip
    link = open_sweep(spec, name, instance, cells, sweep_path)  # 2. the parent run
    status, failed = "FAILED", {}
    try:
        if deployment:  # 3. the unfinished cells
            states = _run_deployed(todo, deployment, spec.concurrency, link, allow_change or [])
        else:
            states = _run_here(todo, link, allow_change or [])
        failed = {name: state for name, state in states.items() if state != "Completed"}
        try:  # 4. the report
            rows = sweep_report(name, cells[0].config.experiment, link.tracking_uri, sweep_path, out)
        except NothingToReport:
            if spec.record is None:
                raise
            log.info(
                "no cell finished in this store; the study's page comes from its record: horizonrl study %s", sweep_path
            )
            rows = []
        if spec.register_best:  # 5. the best cell's policy
            version = register_best(link, spec.register_best)
            log.info("best policy registered as %s version %s", spec.register_best, version)
        if failed:
            raise RuntimeError(f"sweep {name}: cells did not complete: {failed}")
        status = "FINISHED"
    finally:
        close_sweep(link, [cell for cell in todo if cell.run_name in failed], status)
    return rows


@flow(name="sweep-report", log_prints=True)
def sweep_report(
    sweep_name: str,
    experiment: str,
    tracking_uri: str | None = None,
    sweep_path: str | None = None,
    out: str | None = None,
) -> list[dict[str, Any]]:
    """Compare a sweep's finished cells from their MLflow metrics (``horizonrl.tracking.report``) and publish
    the page on the parent run (and at ``out``, e.g. ``docs/results.md``). Same store in, same page out."""
    uri, parent, cells, ctx = report_inputs(sweep_name, experiment, tracking_uri, sweep_path, out)
    rows = publish_report(uri, parent, cells, ctx, out)
    if sweep_path is not None:  # the methods paired by held-out task, from the cells' stored evaluations
        publish_study(uri, parent, sweep_path)
    return rows


def _run_here(cells: list[Cell], link: Link, allow_change: list[str]) -> dict[str, str]:
    """One child train flow after another; a failed cell does not stop the others."""
    from flows.train import train  # here, not at the top: a fanned-out sweep never needs the model stack (~10 s)

    states = {}
    for cell in cells:
        link_cell(link, cell)
        state = train.with_options(flow_run_name=cell.run_name)(
            config=cell.config.model_dump(), allow_change=allow_change, return_state=True
        )
        states[cell.run_name] = state.name
    return states


def _run_deployed(
    cells: list[Cell], deployment: str, concurrency: int, link: Link, allow_change: list[str]
) -> dict[str, str]:
    """Run each cell as a flow run of the train deployment, at most ``concurrency`` at once: each cell is a
    ``sweep-cell`` task that waits for its flow run, on a thread-pool task runner of ``concurrency``
    workers; return final state names."""
    with ThreadPoolTaskRunner(max_workers=concurrency) as runner:
        futures = {
            cell.run_name: runner.submit(
                run_cell, {"cell": cell, "deployment": deployment, "link": link, "allow_change": allow_change}
            )
            for cell in cells
        }
        return {name: f.result() for name, f in futures.items()}
