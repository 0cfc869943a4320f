"""A study's results page, generated from its committed record (``study_record``) and its sweep file: the
methods compared task by task (``study_compare``), the seeds' claims, the learning curves, each cell's cost
and the study's power. Same record in, same page out: a test regenerates the committed page and compares."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from horizonrl.tracking import study_compare as sc
from horizonrl.tracking.stats import Interval, wilson

AXES = {"iteration": "iteration", "env_steps": "environment steps", "wall_min": "training wall time (min)"}


def curves(outcomes: pd.DataFrame, progress: pd.DataFrame) -> pd.DataFrame:
    """Every cell's held-out success at each evaluation, with its environment steps and training minutes there
    (0 at iteration 0): seed, method, iteration, success, episodes, env_steps, wall_min."""
    c = outcomes.groupby(["seed", "method", "iteration"], as_index=False).agg(
        success=("won", "mean"), episodes=("won", "size")
    )
    p = progress[["seed", "method", "iteration", "env_steps", "train_s"]]
    c = c.merge(p, on=["seed", "method", "iteration"], how="left")
    c[["env_steps", "train_s"]] = c[["env_steps", "train_s"]].fillna(0.0)
    c["wall_min"] = c.pop("train_s") / 60
    return c


def cost(progress: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """Minutes per cell: its iterations, its evaluations (the starting one only where the cell played it),
    and the total; with its iterations and environment steps."""
    rows = []
    for cell in cells[cells["method"] != "warmstart"].itertuples():
        p = (
            progress[(progress["seed"] == cell.seed) & (progress["method"] == cell.method)]
            if len(progress)
            else progress
        )
        if p.empty:
            rows.append({"seed": cell.seed, "method": cell.method, "status": cell.status})
            continue
        played_start = cell.eval0_played_by == cell.run_name
        evals = p[(p["iteration"] > 0) | played_start]["eval_s"].sum()
        rows.append(
            {
                "seed": cell.seed,
                "method": cell.method,
                "status": cell.status,
                "iterations": int(cell.iterations),
                "env_steps": p["env_steps"].max(),
                "iterations_min": p["iteration_s"].sum() / 60,
                "evaluations_min": evals / 60,
                "played_start": played_start,
            }
        )
    columns = [
        "seed",
        "method",
        "status",
        "iterations",
        "env_steps",
        "iterations_min",
        "evaluations_min",
        "played_start",
    ]
    return pd.DataFrame(rows, columns=columns)


def plot(curve_table: pd.DataFrame, x: str, methods: list[str], path: Path) -> None:
    """Held-out success against ``x``, one line per cell (colour: method; line style: seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    colours = plt.get_cmap("tab10").colors
    for (seed, method), c in curve_table.groupby(["seed", "method"]):
        c = c.sort_values("iteration")
        style = ("-", "--", ":", "-.")[int(seed) % 4]
        colour = colours[methods.index(method) % 10]
        ax.plot(c[x], c["success"], style, color=colour, marker="o", markersize=3, label=f"{method} seed {seed}")
    ax.set_xlabel(AXES[x])
    ax.set_ylabel("held-out success")
    ax.grid(alpha=0.3, linewidth=0.5)
    if ax.lines:
        ax.legend(fontsize=7, ncols=2)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def _pts(i: Interval) -> str:
    """Points with a sign; a zero is +0.0 whichever way it was rounded."""
    mean, low, high = (100 * v + 0.0 for v in (i.mean, i.low, i.high))
    return f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]".replace("-0.0", "+0.0")


def _rate(won: pd.Series) -> str:
    if won.empty:
        return "not evaluated yet"
    low, high = wilson(float(won.mean()), len(won))
    return f"{won.mean():.3f} [{low:.3f}, {high:.3f}] ({len(won)})"


def _finals_lines(outcomes: pd.DataFrame, finals: pd.DataFrame, methods: list[str], seeds: list[int]) -> list[str]:
    start = outcomes[outcomes["iteration"] == 0].drop_duplicates(["seed", "task"])
    lines = [
        "| policy | " + " | ".join(f"seed {s}: success [95% Wilson] (tasks)" for s in seeds) + " |",
        "|---|" + "---|" * len(seeds),
        "| start (the seed's warm start) | "
        + " | ".join(_rate(start[start["seed"] == s]["won"]) for s in seeds)
        + " |",
    ]
    for m in methods:
        cells = [finals[(finals["seed"] == s) & (finals["method"] == m)]["won"] for s in seeds]
        lines.append(f"| {m} | " + " | ".join(_rate(w) if len(w) else "not finished" for w in cells) + " |")
    return lines


def _pair_lines(pair_list: list[sc.Pair], seeds: list[int]) -> list[str]:
    head = " | ".join(f"seed {s}: a - b, points [95%] (McNemar p)" for s in seeds)
    lines = [
        f"| a | b | {head} | pooled, points [95%] | seeds' spread | verdict |",
        "|---|---|" + "---|" * len(seeds) + "---|---|---|",
    ]
    for p in pair_list:
        by_seed = {s.seed: s for s in p.seeds}
        cells = [
            f"{_pts(by_seed[s].change)} (p={by_seed[s].mcnemar_p:.2g})" if s in by_seed else "not run" for s in seeds
        ]
        spread = "n/a" if math.isnan(p.seed_spread) else f"{100 * p.seed_spread:.1f}"
        lines.append(f"| {p.a} | {p.b} | {' | '.join(cells)} | {_pts(p.pooled)} | {spread} | {p.verdict} |")
    return lines


def _claim_lines(pair_list: list[sc.Pair]) -> list[str]:
    lines = ["| claim | pair | this study | pooled, points [95%] |", "|---|---|---|---|"]
    for better, than, text in sc.CLAIMS:
        verdict, p = sc.claim_verdict(pair_list, better, than)
        figure = "" if p is None else _pts(p.pooled if p.a == better else _negated(p.pooled))
        lines.append(f"| {text} | {better} over {than} | {verdict} | {figure} |")
    return lines


def _negated(i: Interval) -> Interval:
    return Interval(-i.mean, -i.high, -i.low)


def _cost_lines(cost_table: pd.DataFrame, cells: pd.DataFrame) -> list[str]:
    lines = [
        "| seed | method | status | iterations | environment steps | iterations, min | evaluations, min | total, min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in cost_table.itertuples():
        if pd.isna(r.iterations):
            lines.append(f"| {r.seed} | {r.method} | {_state(r.status, 0)} | | | | | |")
            continue
        start = " (incl. the start)" if r.played_start else ""
        total = r.iterations_min + r.evaluations_min
        state = _state(r.status, int(r.iterations))
        steps = "" if pd.isna(r.env_steps) else f"{r.env_steps:,.0f}"  # none logged before its first iteration ends
        lines.append(
            f"| {r.seed} | {r.method} | {state} | {int(r.iterations)} | {steps} | "
            f"{r.iterations_min:.0f} | {r.evaluations_min:.0f}{start} | {total:.0f} |"
        )
    ws = cells[cells["method"] == "warmstart"]
    for r in ws.itertuples():
        lines.append(f"| {r.seed} | warm start (shared) | {_state(r.status, 0)} | | | {r.wall_s / 60:.0f} (wall) | | |")
    return lines


def _state(status: str, iterations: int) -> str:
    """A cell's MLflow status as a reader needs it: a cell the sweep will run or resume is not a failure (a start
    that failed before its first iteration is started afresh; a stopped one resumes at its last checkpoint)."""
    if status == "FINISHED":
        return "finished"
    if iterations > 0:
        return f"in progress (resumes after iteration {iterations})"
    return "to run (its start failed: the sweep starts it afresh)" if status in ("FAILED", "KILLED") else "to run"


def _start_line(start_list: list[sc.Start]) -> str:
    """Whether each seed's cells started from the same policy: their starting evaluations compared."""
    if not start_list:
        return "Starting evaluations: no seed has two cells started yet, so none are compared."
    same = "; ".join(f"seed {s.seed}, {s.method} as {s.first} on {s.tasks} tasks" for s in start_list if not s.differ)
    differ = [
        f"**seed {s.seed}: {s.method} started from other weights than {s.first}** (their starting evaluations differ "
        f"on {s.differ} of {s.tasks} tasks, so their pairs compare different starts)"
        for s in start_list
        if s.differ
    ]
    parts = ([f"identical, so these cells share their start ({same})"] if same else []) + differ
    return f"Starting evaluations (iteration 0) compared within each seed: {'; '.join(parts)}."


def page(outcomes: pd.DataFrame, progress: pd.DataFrame, cells: pd.DataFrame, meta: dict, figures: dict) -> str:
    """The study's page. ``meta``: title, sweep (path), command, record (folder), tuning (text);
    ``figures``: x axis -> file name beside the page."""
    methods = [m for m in dict.fromkeys(cells["method"]) if m != "warmstart"]
    seeds = sorted(int(s) for s in cells["seed"].unique())
    finals = sc.finished_finals(outcomes, cells)
    pair_list = sc.pairs(finals, methods)
    one_seed, pooled, n_seed, n_pooled = sc.power(pair_list)
    told = [p for p in pair_list if p.verdict != "not told apart"]
    done = cells[(cells["status"] == "FINISHED") & (cells["method"] != "warmstart")]
    lines = [
        f"# {meta['title']}",
        "",
        f"Generated by `{meta['command']}` from the study's record in `{meta['record']}` (per-task outcomes of "
        f"every evaluation, per-iteration progress, the cells' status); never edited by hand. Sweep file: "
        f"`{meta['sweep']}`. Cells finished: {len(done)} of {len(cells) - len(cells[cells['method'] == 'warmstart'])}.",
        "",
        "## Final held-out success",
        "",
        *_finals_lines(outcomes, finals, methods, seeds),
        "",
        _start_line(sc.starts(outcomes, cells)),
        "",
        "## Methods compared task by task",
        "",
        "Each cell's last evaluation, paired by held-out task with the other method's of the same seed (the same "
        "warm start, the same tasks): the mean difference of success in points with its 95% bootstrap interval "
        "over tasks, and McNemar's exact p on the tasks the two disagree on; pooled over every (seed, task). A pair "
        "is told apart only when every seed's interval and the pooled one exclude 0 on the same side. The seeds' "
        "spread (largest minus smallest paired mean) is the variation the paired intervals do not hold.",
        "",
        *_pair_lines(pair_list, seeds),
        "",
        f"Told apart: {', '.join(p.verdict for p in told) if told else 'no pair'}.",
        "",
        "## The seeds' claims",
        "",
        *_claim_lines(pair_list),
        "",
        "## Power",
        "",
        (
            f"From the per-task differences of every pair (their standard deviation pooled): a true difference of "
            f"{100 * one_seed:.1f} points is found with 80% power by a two-sided 5% test in one seed ({n_seed} "
            f"tasks), {100 * pooled:.1f} points pooled ({n_pooled} tasks). The verdict asks every seed and the pool "
            "to agree, so differences smaller than the one-seed figure are not expected to be told apart."
            if not math.isnan(one_seed)
            else "No pair of methods has finished in a common seed yet."
        ),
        "",
        "## Learning curves",
        "",
        *(f"![held-out success against {AXES[x]}]({name})" for x, name in figures.items()),
        "",
        "## Cost",
        "",
        "Minutes of this machine per cell (its MLflow `time/iteration_s` and `time/eval_s`); the warm start and the "
        "starting evaluation are played once per seed and read by the seed's other cells.",
        "",
        *_cost_lines(cost(progress, cells), cells),
        "",
        "## What was tuned",
        "",
        meta.get("tuning") or "Nothing stated.",
        "",
    ]
    return "\n".join(lines)


def meta(name: str, sweep_file: str, record: str, out: str, tuning: str | None) -> dict:
    """The page's title and provenance: the command that regenerates it from the record alone."""
    command = f"horizonrl study {sweep_file} --record {record} --out {out} --offline"
    return {"title": f"Study {name}", "sweep": sweep_file, "command": command, "record": record, "tuning": tuning}


def figure_names(out: Path) -> dict[str, str]:
    """x axis -> the file name of its figure, beside the page ``out``."""
    return {x: f"{Path(out).stem}_{x}.png" for x in AXES}


def write(folder: Path, out: Path, meta: dict) -> str:
    """Write the page at ``out`` and its figures beside it, from the record in ``folder``."""
    from horizonrl.tracking.study_record import load

    outcomes, progress, cells = load(folder)
    methods = [m for m in dict.fromkeys(cells["method"]) if m != "warmstart"]
    figures = figure_names(out)
    table = curves(outcomes, progress)
    for x, name in figures.items():
        plot(table, x, methods, out.parent / name)
    text = page(outcomes, progress, cells, meta, figures)
    out.write_text(text)
    return text
