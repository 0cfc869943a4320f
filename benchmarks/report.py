"""Figures of the benchmark suite: one table on stdout, JSON and CSV under benchmarks/out/, one MLflow run.

A figure with ``passed = None`` is reported without a target (a throughput, a size, a count).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from horizonrl.tracking import mlflow_runs

EXPERIMENT = "benchmarks"


@dataclass(frozen=True)
class Figure:
    name: str  # "<section>/<figure>", also the MLflow metric name
    value: float
    unit: str
    target: str  # e.g. ">= 0.7", "" when only reported
    passed: bool | None
    note: str = ""  # what was measured, or the reference it is compared with


def table(figures: list[Figure]) -> str:
    """Fixed-width table: figure, value, target, pass/miss, note."""
    lines = [f"{'figure':<34}{'value':>14} {'unit':<6}{'target':>10}  {'result':<7}note", "-" * 110]
    for f in figures:
        result = "" if f.passed is None else ("pass" if f.passed else "MISS")
        lines.append(f"{f.name:<34}{f.value:>14,.3f} {f.unit:<6}{f.target:>10}  {result:<7}{f.note}")
    scored = [f for f in figures if f.passed is not None]
    lines.append(f"{sum(f.passed for f in scored)}/{len(scored)} targets met")
    return "\n".join(lines)


PUBLISH_START, PUBLISH_END = "<!-- benchmarks:start (written by `make bench`) -->", "<!-- benchmarks:end -->"


def markdown(figures: list[Figure], params: dict[str, object]) -> str:
    """The figures as a Markdown table, headed by when, at which commit and on what they were measured."""
    scored = [f for f in figures if f.passed is not None]
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} at commit `{mlflow_runs.git_commit()[:7]}` on {os.cpu_count()} CPU "
        "cores "
        f"({platform.processor() or platform.machine()}), `python -m benchmarks` "
        f"({'quick sizes' if params.get('quick') else 'full sizes'}): {sum(f.passed for f in scored)} of "
        f"{len(scored)} targets met.",
        "",
        "| figure | value | unit | target | result | what |",
        "|---|---:|---|---|---|---|",
    ]
    for f in figures:
        result = "" if f.passed is None else ("pass" if f.passed else "**miss**")
        lines.append(f"| `{f.name}` | {f.value:,.3f} | {f.unit} | {f.target} | {result} | {f.note.replace('|', '/')} |")
    return "\n".join(lines)


def publish(figures: list[Figure], params: dict[str, object], page: Path) -> None:
    """Replace the block between the markers in ``page`` (docs/benchmarks.md) with the table, so the numbers
    shown are the ones measured, never typed."""
    text = page.read_text()
    if PUBLISH_START not in text or PUBLISH_END not in text:
        raise ValueError(f"{page} has no benchmark block: add the lines {PUBLISH_START!r} and {PUBLISH_END!r}")
    head, rest = text.split(PUBLISH_START, 1)
    page.write_text(f"{head}{PUBLISH_START}\n{markdown(figures, params)}\n{PUBLISH_END}{rest.split(PUBLISH_END, 1)[1]}")


def save(figures: list[Figure], out_dir: Path, params: dict[str, object]) -> tuple[Path, Path]:
    """Write ``figures.json`` (with the run's parameters) and ``figures.csv``; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, cs = out_dir / "figures.json", out_dir / "figures.csv"
    js.write_text(
        json.dumps(
            {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "params": params, "figures": [asdict(f) for f in figures]},
            indent=1,
        )
    )
    with open(cs, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(asdict(figures[0])))
        writer.writeheader()
        writer.writerows(asdict(f) for f in figures)
    return js, cs


def log_mlflow(
    figures: list[Figure], params: dict[str, object], files: tuple[Path, ...], tracking_uri: str | None = None
) -> str:
    """One run in the ``benchmarks`` experiment: every figure as a metric (step 0), pass/miss as tags,
    the table files as artifacts, so that runs can be compared over time. Returns the run id."""
    c = mlflow_runs.client(mlflow_runs.tracking_uri(tracking_uri))
    run_id, _ = mlflow_runs.find_or_create_run(
        c,
        EXPERIMENT,
        f"bench-{time.strftime('%Y%m%d-%H%M%S')}",
        {"git_commit": mlflow_runs.git_commit(), "host": platform.node()},
    )
    mlflow_runs.log_params(c, run_id, {k: str(v) for k, v in params.items()})
    by_section: dict[str, dict[str, float]] = {}
    for f in figures:
        section, name = f.name.split("/", 1)
        by_section.setdefault(section, {})[name] = f.value
    for section, values in by_section.items():
        mlflow_runs.log_metrics(c, run_id, section, values, 0)
    mlflow_runs.set_tags(
        c, run_id, {f"target.{f.name}": "pass" if f.passed else "miss" for f in figures if f.passed is not None}
    )
    for path in files:
        c.log_artifact(run_id, str(path))
    c.set_terminated(run_id, "FINISHED")
    return run_id
