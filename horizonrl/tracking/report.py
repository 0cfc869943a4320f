"""The comparison report of a sweep, computed from metric histories only (no MLflow, no Prefect).

One *cell* is one training run; cells that differ only in their seed form a *variant* (usually a method).
Per variant: final and best held-out success (``eval/success_rate``), the area under the learning curve,
and the change of held-out success from a cell's first evaluation (the policy it started from, evaluated
in that run) to its last, each as a mean over seeds with a 95% percentile-bootstrap interval of that mean
(resampling seeds, ``BOOTSTRAP`` resamples, a fixed generator: the same numbers every time). The interval of a mean of
success rates stays inside [0, 1]; with one seed there is none (NaN), and with 2 or 3 seeds it is the
seeds' range (every extreme resample has probability > 2.5%), so the page warns below ``MIN_SEEDS`` and
names every pair of variants whose intervals overlap. Generated tokens, environment steps and training
wall time are means over seeds.

Environment steps per iteration are the train flow's ``time/env_steps`` (cumulative, every episode's turns,
APPO's branches included); runs that predate it fall back to ``collect/episodes`` x ``collect/mean_turns``.

A run also logs its own change paired by held-out task (``eval/paired_change``: the same tasks at its two
ends, the interval resampling tasks); per seed, the page says whether each interval excludes 0.

This module summarises and judges; ``stats`` holds the intervals, ``results_page`` renders the published
page (``docs/results.md``) and ``plots`` its figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from horizonrl.tracking.stats import Interval, interval, newcombe

MIN_SEEDS = 3  # below this a variant has no interval (1 seed) or just its two values: too few to separate methods


X_AXES = {"iterations": "iteration", "env_steps": "environment steps", "wall_s": "training wall time (s)"}


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
    env_steps: dict[int, float] = field(default_factory=dict)  # time/env_steps (cumulative)
    wall_s: dict[int, float] = field(default_factory=dict)  # time/train_s (cumulative)
    families: dict[str, dict[int, float]] = field(default_factory=dict)  # eval/success_rate/<family>, by family
    eval_episodes: dict[int, float] = field(default_factory=dict)  # eval/episodes: held-out episodes behind each point
    paired: PairedChange | None = None  # eval/paired_change at the last evaluation; None where the run logged none


@dataclass(frozen=True)
class PairedChange:
    """One seed's change of held-out success from its first evaluation to its last over the tasks both
    played, with the 95% interval resampling tasks (``stats.paired_change``), as the run logged it."""

    change: Interval
    tasks: int
    first: float = float("nan")  # held-out success at the first evaluation, over all its episodes
    last: float = float("nan")  # and at the last


@dataclass(frozen=True)
class VariantSummary:
    variant: str
    seeds: int
    final: Interval
    best: Interval
    auc: Interval
    tokens: float
    train_s: float
    env_steps: float = float("nan")
    change: Interval = Interval(float("nan"), float("nan"), float("nan"))  # final minus first evaluation, per seed
    families: dict[str, Interval] = field(default_factory=dict)  # final success per task family, by family
    pooled_change: PooledChange | None = None  # the change over all seeds' episodes; None without episode counts
    pooled_final: Pooled | None = None  # final success over all seeds' last-evaluation episodes
    paired: dict[int, PairedChange | None] = field(default_factory=dict)  # by seed; empty when no seed logged one


@dataclass(frozen=True)
class Pooled:
    """A success rate over every seed's episodes of one evaluation (first or last)."""

    rate: float
    episodes: int


@dataclass(frozen=True)
class PooledChange:
    """Final minus first held-out success with every seed's episodes pooled: its 95% interval is
    binomial (it leaves out the spread between seeds, which the interval over seeds holds)."""

    change: Interval
    first_episodes: int
    final_episodes: int


@dataclass(frozen=True)
class Curve:
    """A variant's learning curve: at each evaluated iteration, the mean over seeds and its interval;
    ``seeds`` holds each seed's own (x, success) points for every x axis."""

    variant: str
    iterations: list[int]
    env_steps: list[float]  # the seeds' mean cumulative environment steps at that iteration
    mean: list[float]
    half: list[float]
    low: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)  # the seeds' mean training wall time at that iteration
    seeds: list[dict[str, list[float]]] = field(
        default_factory=list
    )  # per seed: iterations, env_steps, wall_s, success


@dataclass(frozen=True)
class Claim:
    text: str
    order: list[str]  # variants, claimed best first


@dataclass(frozen=True)
class Drift:
    """A variant whose final success left the previous instance's interval."""

    variant: str
    now: float
    before: Interval


CLAIMS = [
    Claim(
        "LOOP: importance ratio per token > per turn > per trajectory",
        ["loop", "loop loss_params.ratio_level=turn", "loop loss_params.ratio_level=trajectory"],
    ),
    Claim(
        "LOOP: std normalisation of the advantage hurts (without > with)",
        ["loop", "loop advantage_params.normalize_std=True"],
    ),
    Claim("BLPO > GiGPO > GRPO on long-horizon household tasks", ["blpo", "gigpo", "grpo"]),
    Claim("APPO above its GRPO-style baseline", ["appo", "grpo"]),
]


def variant_name(coords: dict[str, Any]) -> str:
    """A grid cell's variant: its method, then its other coordinates but the seed as ``key=value`` in key
    order (``loop loss_params.ratio_level=turn``), the names ``CLAIMS`` use; ``base`` when it has none."""
    rest = [f"{k}={v}" for k, v in sorted(coords.items()) if k not in ("method", "seed")]
    method = [str(coords["method"])] if "method" in coords else []
    return " ".join(method + rest) or "base"


def pooled(group: list[CellHistory], last: bool) -> Pooled | None:
    """Success over every seed's episodes of its first (or last) evaluation; None when a seed lacks that
    evaluation's episode count."""
    won = n = 0.0
    for c in group:
        it = max(c.success) if last else min(c.success)
        if it not in c.eval_episodes:
            return None
        won, n = won + c.success[it] * c.eval_episodes[it], n + c.eval_episodes[it]
    return Pooled(won / n, round(n)) if n else None


def cells_start(cells: list[CellHistory]) -> tuple[Pooled, int] | None:
    """The starting policy as the cells evaluated it: each seed's first evaluation pooled over the seeds,
    and the number of seeds. Cells of one seed that start from the same policy sample the same episodes,
    so each seed counts once; None when they disagree (not one starting policy) or lack episode counts."""
    by_seed: dict[int, list[CellHistory]] = {}
    for c in cells:
        by_seed.setdefault(c.seed, []).append(c)
    if any(
        len({(c.success[min(c.success)], c.eval_episodes.get(min(c.success))) for c in group}) != 1
        for group in by_seed.values()
    ):
        return None
    start = pooled([group[0] for group in by_seed.values()], last=False)
    return (start, len(by_seed)) if start is not None else None


def pooled_change(group: list[CellHistory]) -> PooledChange | None:
    """The change from each seed's first evaluation to its last, the seeds' episodes pooled; None without
    the episode counts, or when a seed has one evaluation only."""
    first, final = pooled(group, last=False), pooled(group, last=True)
    if first is None or final is None or any(len(c.success) < 2 for c in group):
        return None
    return PooledChange(
        newcombe(first.rate, first.episodes, final.rate, final.episodes), first.episodes, final.episodes
    )


def compare(a: VariantSummary, b: VariantSummary) -> str:
    """``above`` / ``below`` when ``a``'s final success is told apart from ``b``'s, else ``overlap``: the
    intervals over seeds must be disjoint and, with episode counts, the pooled binomial interval of the
    difference must exclude 0 on the same side (the same two-interval rule as ``improvement``)."""
    by_seeds = _order(a.final, b.final)
    if a.pooled_final is None or b.pooled_final is None or by_seeds == "overlap":
        return by_seeds
    d = newcombe(b.pooled_final.rate, b.pooled_final.episodes, a.pooled_final.rate, a.pooled_final.episodes)
    return by_seeds if _order(d, Interval(0.0, 0.0, 0.0)) == by_seeds else "overlap"


def env_steps(cell: CellHistory) -> dict[int, float]:
    """Cumulative environment steps after each iteration (0 before the first)."""
    if cell.env_steps:
        return {0: 0.0, **cell.env_steps}
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
    """final, best, auc, change (final minus the first evaluation), tokens, env_steps and train_s of one run."""
    if not cell.success:
        raise ValueError(f"variant {cell.variant!r} seed {cell.seed}: no eval/success_rate logged")
    tokens = sum(n * cell.tokens_per_episode.get(it, 0.0) for it, n in cell.episodes.items())
    steps = env_steps(cell)
    final = cell.success[max(cell.success)]
    return {
        "final": final,
        "best": max(cell.success.values()),
        "auc": auc(cell.success),
        "change": final - cell.success[min(cell.success)],
        "tokens": float(tokens),
        "train_s": cell.train_s,
        "env_steps": steps[max(steps)],
    }


def summarize(cells: list[CellHistory]) -> list[VariantSummary]:
    """One summary per variant, by variant name; seeds in seed order."""
    out = []
    for variant, group in _by_variant(cells).items():
        figs = [seed_figures(c) for c in group]
        col = {k: [f[k] for f in figs] for k in figs[0]}
        out.append(
            VariantSummary(
                variant=variant,
                seeds=len(group),
                final=interval(col["final"]),
                best=interval(col["best"]),
                auc=interval(col["auc"]),
                tokens=float(np.mean(col["tokens"])),
                train_s=float(np.mean(col["train_s"])),
                env_steps=float(np.mean(col["env_steps"])),
                change=interval(col["change"]),
                families=_family_finals(group),
                pooled_change=pooled_change(group),
                pooled_final=pooled(group, last=True),
                paired={c.seed: c.paired for c in group} if any(c.paired for c in group) else {},
            )
        )
    return out


def _family_finals(group: list[CellHistory]) -> dict[str, Interval]:
    """Per task family, the interval over seeds of its success at each seed's last evaluation (families a
    seed never evaluated are left out of that seed)."""
    names = sorted({f for c in group for f in c.families})
    return {f: interval([c.families[f][max(c.families[f])] for c in group if c.families.get(f)]) for f in names}


def curves(cells: list[CellHistory]) -> list[Curve]:
    """Per variant, the mean and interval over the seeds evaluated at each iteration, and each seed's points."""
    out = []
    for variant, group in _by_variant(cells).items():
        iterations = sorted({it for c in group for it in c.success})
        steps = [env_steps(c) for c in group]
        walls = [{0: 0.0, **c.wall_s} for c in group]
        mean, low, high, xs, ws = [], [], [], [], []
        for it in iterations:
            ci = interval([c.success[it] for c in group if it in c.success])
            mean.append(ci.mean)
            low.append(ci.low)
            high.append(ci.high)
            xs.append(float(np.mean([at_iteration(s, it) for s in steps])))
            ws.append(float(np.mean([at_iteration(w, it) for w in walls])))
        seeds = [
            {
                "iterations": [float(it) for it in sorted(c.success)],
                "env_steps": [at_iteration(s, it) for it in sorted(c.success)],
                "wall_s": [at_iteration(w, it) for it in sorted(c.success)],
                "success": [c.success[it] for it in sorted(c.success)],
            }
            for c, s, w in zip(group, steps, walls)
        ]
        half = [(h - lo) / 2 for lo, h in zip(low, high)]
        out.append(
            Curve(
                variant=variant,
                iterations=iterations,
                env_steps=xs,
                mean=mean,
                half=half,
                low=low,
                high=high,
                wall_s=ws,
                seeds=seeds,
            )
        )
    return out


def table(summaries: list[VariantSummary]) -> list[dict[str, float | int | str]]:
    """Flat rows (one per variant) for MLflow's table view and Prefect's table artifact."""
    rows = []
    for s in summaries:
        row: dict[str, float | int | str] = {"variant": s.variant, "seeds": s.seeds}
        for name in ("final", "best", "auc", "change"):
            ci: Interval = getattr(s, name)
            row.update({f"{name}_mean": ci.mean, f"{name}_low": ci.low, f"{name}_high": ci.high})
        row.update(env_steps=s.env_steps, tokens=s.tokens, train_s=s.train_s)
        rows.append(row)
    return rows


def judge(claim: Claim, summaries: list[VariantSummary]) -> str:
    """``holds`` when every claimed-better variant's final success is told apart above the next one's
    (``compare``), ``does not hold`` when one is below, else ``cannot be told apart`` (or ``not measured``)."""
    by = {s.variant: s for s in summaries}
    missing = [v for v in claim.order if v not in by]
    if missing:
        return f"not measured ({', '.join(missing)} absent)"
    verdicts = [compare(by[a], by[b]) for a, b in zip(claim.order, claim.order[1:])]
    if "below" in verdicts:
        return "does not hold"
    return "holds" if all(v == "above" for v in verdicts) else "cannot be told apart"


def improvement(s: VariantSummary) -> str:
    """``improves`` when the interval of the change from the start lies above 0, ``worsens`` when below,
    else ``no change told apart`` (also with one seed: no interval). With episode counts, the pooled
    binomial interval must agree: a percentile bootstrap over 3 seeds is narrower than the seeds warrant,
    and the pooled interval leaves out their spread, so a verdict needs both."""
    zero = Interval(0.0, 0.0, 0.0)
    by_seeds = _order(s.change, zero)
    if s.pooled_change is not None and _order(s.pooled_change.change, zero) != by_seeds:
        return "no change told apart"
    return {"above": "improves", "below": "worsens"}.get(by_seeds, "no change told apart")


def paired_sides(s: VariantSummary) -> dict[int, str]:
    """Per seed, where its paired interval (``PairedChange``) lies: ``above`` or ``below`` 0, else
    ``includes 0``, ``has no interval`` (one task) or ``not logged``."""
    return {seed: _paired_side(p) for seed, p in s.paired.items()}


def _paired_side(p: PairedChange | None) -> str:
    if p is None:
        return "not logged"
    if math.isnan(p.change.low):
        return "has no interval"
    return {"above": "above", "below": "below"}.get(_order(p.change, Interval(0.0, 0.0, 0.0)), "includes 0")


def paired_verdict(s: VariantSummary) -> str:
    """In words, whether every seed's paired interval excludes 0, and on which side."""
    sides = paired_sides(s)
    if set(sides.values()) in ({"above"}, {"below"}):
        return f"every seed's interval excludes 0 (all {next(iter(sides.values()))} 0)"
    if set(sides.values()) <= {"above", "below"}:
        return "every seed's interval excludes 0 (not all on one side)"
    named = [f"seed {seed} {side}" for seed, side in sides.items() if side not in ("above", "below")]
    return f"not every seed's interval excludes 0 ({', '.join(named)})"


def drifts(now: list[VariantSummary], before: list[VariantSummary]) -> list[Drift]:
    """Variants whose final success (mean over seeds) falls outside the previous instance's interval."""
    prev = {s.variant: s for s in before}
    out = []
    for s in now:
        p = prev.get(s.variant)
        if p is not None and not math.isnan(p.final.low) and not p.final.low <= s.final.mean <= p.final.high:
            out.append(Drift(s.variant, s.final.mean, p.final))
    return out


def _order(a: Interval, b: Interval) -> str:
    """``above`` / ``below`` when the intervals are disjoint, else ``overlap`` (also without intervals)."""
    if math.isnan(a.low) or math.isnan(b.low):
        return "overlap"
    if a.low > b.high:
        return "above"
    return "below" if a.high < b.low else "overlap"


def _by_variant(cells: list[CellHistory]) -> dict[str, list[CellHistory]]:
    """Variants by name, each one's seeds in seed order: the page does not depend on the cells' order."""
    groups: dict[str, list[CellHistory]] = {}
    for c in cells:
        groups.setdefault(c.variant, []).append(c)
    return {v: sorted(groups[v], key=lambda c: c.seed) for v in sorted(groups)}
