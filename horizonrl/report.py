"""The comparison report of a sweep, computed from metric histories only (no MLflow, no Prefect).

One *cell* is one training run; cells that differ only in their seed form a *variant* (usually a method).
Per variant: final and best held-out success (``eval/success_rate``) and the area under the learning
curve, each as a mean over seeds with a 95% Student-t interval (t_{0.975, n-1} * s / sqrt(n), sample std;
undefined, NaN, for one seed); generated tokens and training wall time, as means over seeds.

Environment steps are counted from the collect figures: sum over iterations of ``collect/episodes`` x
``collect/mean_turns`` (initial rollouts; APPO branch steps are not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class CellHistory:
    """What the report needs of one run, each history keyed by iteration."""

    variant: str
    seed: int
    success: dict[int, float]  # eval/success_rate
    episodes: dict[int, float] = field(default_factory=dict)  # collect/episodes
    mean_turns: dict[int, float] = field(default_factory=dict)  # collect/mean_turns
    tokens_per_episode: dict[int, float] = field(default_factory=dict)  # collect/tokens_per_episode
    train_s: float = float("nan")  # last time/train_s


@dataclass(frozen=True)
class Interval:
    mean: float
    half: float  # half-width of the 95% interval (NaN for one seed)


@dataclass(frozen=True)
class VariantSummary:
    variant: str
    seeds: int
    final: Interval
    best: Interval
    auc: Interval
    tokens: float
    train_s: float


@dataclass(frozen=True)
class Curve:
    """A variant's learning curve: at each evaluated iteration, the mean over seeds and its interval."""

    variant: str
    iterations: list[int]
    env_steps: list[float]  # the seeds' mean cumulative environment steps at that iteration
    mean: list[float]
    half: list[float]


def interval(values: list[float]) -> Interval:
    """Mean and the half-width of the two-sided 95% t-interval over seeds."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return Interval(float(x.mean()) if len(x) else float("nan"), float("nan"))
    return Interval(float(x.mean()), float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))))


def env_steps(cell: CellHistory) -> dict[int, float]:
    """Cumulative environment steps after each iteration (0 before the first)."""
    total, out = 0.0, {0: 0.0}
    for it in sorted(cell.episodes):
        total += cell.episodes[it] * cell.mean_turns.get(it, 0.0)
        out[it] = total
    return out


def at_iteration(cumulative: dict[int, float], iteration: int) -> float:
    """The cumulative count after the last iteration at or before ``iteration``."""
    done = [it for it in cumulative if it <= iteration]
    return cumulative[max(done)] if done else 0.0


def auc(success: dict[int, float]) -> float:
    """Trapezoidal area under success-vs-iteration divided by the iterations spanned: the curve's mean
    height, in success units, so runs of different lengths compare."""
    steps = sorted(success)
    if len(steps) == 1:
        return success[steps[0]]
    y = [success[s] for s in steps]
    return float(np.trapezoid(y, steps) / (steps[-1] - steps[0]))


def seed_figures(cell: CellHistory) -> dict[str, float]:
    """final, best, auc, tokens and train_s of one run."""
    if not cell.success:
        raise ValueError(f"variant {cell.variant!r} seed {cell.seed}: no eval/success_rate logged")
    tokens = sum(n * cell.tokens_per_episode.get(it, 0.0) for it, n in cell.episodes.items())
    return {"final": cell.success[max(cell.success)], "best": max(cell.success.values()), "auc": auc(cell.success),
            "tokens": float(tokens), "train_s": cell.train_s}


def summarize(cells: list[CellHistory]) -> list[VariantSummary]:
    """One summary per variant, in order of first appearance."""
    out = []
    for variant, group in _by_variant(cells).items():
        figs = [seed_figures(c) for c in group]
        col = {k: [f[k] for f in figs] for k in figs[0]}
        out.append(VariantSummary(variant, len(group), interval(col["final"]), interval(col["best"]), interval(col["auc"]),
                                  float(np.mean(col["tokens"])), float(np.mean(col["train_s"]))))
    return out


def curves(cells: list[CellHistory]) -> list[Curve]:
    """Per variant, the mean and interval over the seeds evaluated at each iteration."""
    out = []
    for variant, group in _by_variant(cells).items():
        iterations = sorted({it for c in group for it in c.success})
        steps = [env_steps(c) for c in group]
        mean, half, xs = [], [], []
        for it in iterations:
            ci = interval([c.success[it] for c in group if it in c.success])
            mean.append(ci.mean)
            half.append(ci.half)
            xs.append(float(np.mean([at_iteration(s, it) for s in steps])))
        out.append(Curve(variant, iterations, xs, mean, half))
    return out


def table(summaries: list[VariantSummary]) -> list[dict[str, float | int | str]]:
    """Flat rows (one per variant) for MLflow's table view and Prefect's table artifact."""
    rows = []
    for s in summaries:
        row: dict[str, float | int | str] = {"variant": s.variant, "seeds": s.seeds}
        for name in ("final", "best", "auc"):
            ci: Interval = getattr(s, name)
            row.update({f"{name}_mean": ci.mean, f"{name}_ci95": ci.half})
        row.update(tokens=s.tokens, train_s=s.train_s)
        rows.append(row)
    return rows


def markdown(title: str, summaries: list[VariantSummary]) -> str:
    """The table as Markdown, intervals written mean ± half-width."""
    lines = [f"# {title}", "", "Held-out success (`eval/success_rate`), mean ± 95% t-interval over seeds.", "",
             "| variant | seeds | final | best | AUC | tokens | train s |", "|---|---|---|---|---|---|---|"]
    for s in summaries:
        cells = " | ".join(f"{ci.mean:.3f} ± {ci.half:.3f}" for ci in (s.final, s.best, s.auc))
        lines.append(f"| {s.variant} | {s.seeds} | {cells} | {s.tokens:,.0f} | {s.train_s:.1f} |")
    return "\n".join(lines) + "\n"


def plot(curve_list: list[Curve], x: str):
    """Success against ``x`` ("iterations" or "env_steps"): one line per variant with its interval band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for c in curve_list:
        xs, y, h = np.asarray(getattr(c, x), dtype=float), np.asarray(c.mean), np.nan_to_num(np.asarray(c.half))
        ax.plot(xs, y, marker="o", label=c.variant)
        ax.fill_between(xs, y - h, y + h, alpha=0.2)
    ax.set_xlabel({"iterations": "iteration", "env_steps": "environment steps"}[x])
    ax.set_ylabel("held-out success rate")
    ax.legend()
    fig.tight_layout()
    return fig


def _by_variant(cells: list[CellHistory]) -> dict[str, list[CellHistory]]:
    groups: dict[str, list[CellHistory]] = {}
    for c in cells:
        groups.setdefault(c.variant, []).append(c)
    return groups
