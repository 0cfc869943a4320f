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

``results_page`` writes the published page (``docs/results.md``): the table with the warm-start row, the
learning curves (each seed thin under the mean and its band), one line per paper claim judged by the
intervals, the comparison with a previous instance, and how to regenerate it. Same histories in, same page
out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BOOTSTRAP = 10_000  # resamples of the seeds
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


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float  # 95% interval of the mean (NaN for one seed)
    high: float

    @property
    def half(self) -> float:
        """Half the interval's width (NaN for one seed)."""
        return (self.high - self.low) / 2


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
class WarmStart:
    """The policy every cell starts from: its model URI, source run and held-out success."""

    model_uri: str
    run_id: str
    success: float
    episodes: int  # held-out episodes behind ``success`` (for its binomial interval)


@dataclass(frozen=True)
class PageContext:
    """Where the page's numbers come from, printed on it so anyone can regenerate it."""

    title: str
    commits: list[str]
    configs: list[str]  # sweep file and base config, repository paths
    command: str  # the command that regenerates the page
    tracking_uri: str
    parent_run_id: str
    warm_start: WarmStart | None = None
    previous: str | None = None  # name of the instance compared against
    previous_summaries: list[VariantSummary] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)  # cell runs of the sweep left out: not finished yet
    code_changes: list[str] | None = None  # files a cell runs that differ between ``commits``; None: not compared
    tuning: str | None = None  # the sweep file's account of what was tuned


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


def interval(values: list[float]) -> Interval:
    """Mean and the 95% percentile-bootstrap interval of the mean over seeds (fixed generator)."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return Interval(float(x.mean()) if len(x) else float("nan"), float("nan"), float("nan"))
    rng = np.random.default_rng(0)
    means = x[rng.integers(0, len(x), size=(BOOTSTRAP, len(x)))].mean(axis=1)  # (B,)
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(float(x.mean()), float(low), float(high))


def paired_difference(control: dict[int, float], run: dict[int, float], first: int, last: int) -> tuple[Interval, int]:
    """Mean of ``run[i] - control[i]`` over the iterations ``first..last`` both have, with the 95%
    percentile-bootstrap interval of that mean (resampling iterations), and how many iterations it used.

    Why: two runs of one seed sample the same training tasks at each iteration, so their collect success
    differs by the update alone plus sampling noise; against a run whose update moves nothing (a frozen
    control), the paired difference shows an effect far smaller than the per-iteration task mix hides.
    The interval treats iterations as independent draws: it is the sampling noise of one seed's
    comparison, not the spread between seeds (run another seed with its own control for that)."""
    shared = [i for i in range(first, last + 1) if i in control and i in run]
    return interval([run[i] - control[i] for i in shared]), len(shared)


def wilson(p: float, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a success rate ``p`` over ``n`` episodes (inside [0, 1])."""
    if n <= 0:
        return float("nan"), float("nan")
    z = 1.959963984540054
    centre, spread = (
        (p + z * z / (2 * n)) / (1 + z * z / n),
        z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n),
    )
    return max(0.0, centre - spread), min(1.0, centre + spread)


def newcombe(p1: float, n1: int, p2: float, n2: int) -> Interval:
    """``p2 - p1`` and its 95% interval from the two Wilson intervals (Newcombe's hybrid score method):
    inside [-1, 1], sound near 0 and 1 where the Wald interval is not."""
    l1, u1 = wilson(p1, n1)
    l2, u2 = wilson(p2, n2)
    d = p2 - p1
    return Interval(d, d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2), d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2))


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
                variant,
                len(group),
                interval(col["final"]),
                interval(col["best"]),
                interval(col["auc"]),
                float(np.mean(col["tokens"])),
                float(np.mean(col["train_s"])),
                float(np.mean(col["env_steps"])),
                interval(col["change"]),
                _family_finals(group),
                pooled_change(group),
                pooled(group, last=True),
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
        out.append(Curve(variant, iterations, xs, mean, half, low, high, ws, seeds))
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


def drifts(now: list[VariantSummary], before: list[VariantSummary]) -> list[Drift]:
    """Variants whose final success (mean over seeds) falls outside the previous instance's interval."""
    prev = {s.variant: s for s in before}
    out = []
    for s in now:
        p = prev.get(s.variant)
        if p is not None and not math.isnan(p.final.low) and not p.final.low <= s.final.mean <= p.final.high:
            out.append(Drift(s.variant, s.final.mean, p.final))
    return out


def markdown(title: str, summaries: list[VariantSummary]) -> str:
    """The table alone as Markdown (the sweep's Prefect artifact)."""
    return "\n".join([f"# {title}", "", *_table_lines(summaries, None), ""])


def _commit_lines(ctx: PageContext) -> list[str]:
    """The code behind the numbers: a sweep resumed after a pull runs its later cells (and the rest of a
    killed one) at newer commits, so the page says what differs between them that a cell runs."""
    if len(ctx.commits) <= 1:
        return [f"- commit: {''.join(f'`{c}`' for c in ctx.commits) or 'unknown'}"]
    if ctx.code_changes is None:
        changed = "not compared (git here does not know every commit)"
    elif not ctx.code_changes:
        changed = "none (only documentation, tests or scripts differ)"
    else:
        changed = ", ".join(f"`{f}`" for f in ctx.code_changes)
    return [
        f"- commits: the cells ran at {len(ctx.commits)} commits: {', '.join(f'`{c}`' for c in ctx.commits)}",
        f"- code and configs that differ between those commits: {changed}",
    ]


def results_page(cells: list[CellHistory], ctx: PageContext, figures: dict[str, str]) -> str:
    """The published page: ``figures`` maps each x axis of ``X_AXES`` to the figure's file name beside it."""
    summaries = summarize(cells)
    lines = [
        f"# {ctx.title}",
        "",
        "Generated by the report command from finished runs in the MLflow store; do not edit by hand.",
        "",
        *_commit_lines(ctx),
        f"- configs: {', '.join(f'`{c}`' for c in ctx.configs)}",
        f"- MLflow: `{ctx.tracking_uri}`, sweep parent run `{ctx.parent_run_id}`",
    ]
    if ctx.warm_start is not None:
        lines.append(
            f"- every cell starts from the warm start `{ctx.warm_start.model_uri}` (run `{ctx.warm_start.run_id}`)"
        )
    lines.append(
        f"- cells: {len(cells)} finished"
        + (
            f"; **{len(ctx.unfinished)} not finished, left out**: {', '.join(f'`{n}`' for n in ctx.unfinished)}"
            if ctx.unfinished
            else ", every cell of the sweep"
        )
    )
    lines += [
        "",
        "## Held-out success",
        "",
        *_table_lines(summaries, ctx.warm_start, cells_start(cells) if ctx.warm_start else None),
        "",
        "Each cell: mean over seeds [95% percentile-bootstrap interval of the mean, resampling seeds]; "
        "the warm start: its own last evaluation, and below it the cells' first evaluations of the same policy "
        "[95% Wilson interval over the held-out episodes]; they differ only in the sampling seed, so their gap is "
        "the evaluation's noise. "
        "AUC: area under success against iteration over the iterations spanned (the curve's mean height). "
        "Change: final minus the cell's first evaluation (its starting policy, evaluated in the same run).",
        "",
    ]
    lines += _separation_warnings(summaries)
    lines += [
        "## Against the starting policy",
        "",
        "Judged by two 95% intervals of the change (final minus first evaluation): over seeds (percentile bootstrap; "
        "with few seeds narrower than they warrant) and pooled over every seed's held-out episodes (Newcombe's interval "
        "for a difference of two proportions; it leaves out the spread between seeds). *improves* when both lie above 0, "
        "*worsens* when both lie below, else *no change told apart*.",
        "",
    ]
    verdicts = {s.variant: improvement(s) for s in summaries}
    lines += [
        f"- {s.variant}: **{verdicts[s.variant]}** ({_ci(s.change, signed=True)} over seeds{_pooled(s.pooled_change)})"
        for s in summaries
    ]
    better = [v for v, verdict in verdicts.items() if verdict == "improves"]
    lines += [
        "",
        f"Improves on its starting policy with 95% intervals above no change: {', '.join(better) if better else 'no variant'}.",
        "",
    ]
    lines += _family_lines(summaries)
    lines += ["## Learning curves", ""]
    for n, (x, name) in enumerate(figures.items(), start=1):
        lines += [
            f"![held-out success against {X_AXES[x]}]({name})",
            "",
            f"*Figure {n}. Held-out success against {X_AXES[x]}, one panel per variant: thin lines are single seeds, the thick "
            "line their mean, the band the 95% percentile-bootstrap interval of the mean over seeds at each evaluation; grey "
            "lines are the other variants' means. The y axis spans the data, not 0 to 1.*",
            "",
        ]
    lines += [
        "## What was tuned",
        "",
        " ".join((ctx.tuning or "The sweep file does not say (its `tuning` field).").split()),
        "",
    ]
    lines += [
        "## The papers' claims at this scale",
        "",
        "Judged by final success as variants are ordered above (intervals over seeds disjoint and, where episodes "
        "are counted, the pooled interval of the difference on the same side of 0): *holds* when each claimed-better "
        "variant is above the next, *does not hold* when one is below, else *cannot be told apart*.",
        "",
    ]
    by = {s.variant: s for s in summaries}
    for c in CLAIMS:
        figures = " > ".join(f"{v} {_ci(by[v].final)}" for v in c.order if v in by)
        lines.append(f"- {c.text}: **{judge(c, summaries)}**" + (f" ({figures})" if figures else ""))
    if ctx.previous is not None:
        found = drifts(summaries, ctx.previous_summaries)
        lines += ["", f"## Compared with the previous instance ({ctx.previous})", ""]
        lines += [
            f"- ⚠ {d.variant}: final success {d.now:.3f}, outside the previous interval [{d.before.low:.3f}, {d.before.high:.3f}]"
            for d in found
        ]
        lines += [] if found else ["- every variant's final success lies inside the previous instance's interval"]
    lines += ["", "## Regenerate", "", f"    {ctx.command}", ""]
    return "\n".join(lines)


def plot(curve_list: list[Curve], x: str):
    """Success against ``x`` (a key of ``X_AXES``), one panel per variant on shared axes: each seed thin
    (label ``_seed``), the mean thick with its band (labelled with the variant), and the other variants'
    means in grey behind (``_context``), so eleven overlapping curves stay readable. The y axis spans the
    data (inside [0, 1]): a study's differences of a few points vanish on a 0-1 axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ncols = min(4, len(curve_list))
    nrows = -(-len(curve_list) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(3.2 * ncols, 2.6 * nrows + 0.4), dpi=100, sharex=True, sharey=True, squeeze=False
    )
    colours = plt.get_cmap("tab10").colors
    means = [(np.asarray(getattr(c, x), dtype=float), c.mean) for c in curve_list]
    ys = [
        v
        for c in curve_list
        for v in [*c.mean, *c.low, *c.high, *(y for s in c.seeds for y in s["success"])]
        if not math.isnan(v)
    ]
    for k, (ax, c) in enumerate(zip(axes.flat, curve_list)):
        colour = colours[k % 10]
        for j, (xs, mean) in enumerate(means):
            if j != k:
                ax.plot(xs, mean, color="0.8", linewidth=0.8, label="_context", zorder=1)
        for seed in c.seeds:
            ax.plot(seed[x], seed["success"], color=colour, linewidth=0.6, alpha=0.5, label="_seed", zorder=2)
        xs = means[k][0]
        if c.low and not all(math.isnan(v) for v in c.low):
            ax.fill_between(xs, c.low, c.high, color=colour, alpha=0.2, linewidth=0, zorder=2)
        ax.plot(xs, c.mean, color=colour, linewidth=2.0, marker="o", markersize=3, label=c.variant, zorder=3)
        ax.set_title(c.variant.replace(" ", "\n", 1) if len(c.variant) > 30 else c.variant, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, linewidth=0.5)
    for k, ax in enumerate(axes.flat):
        if k >= len(curve_list):
            ax.set_visible(False)
        elif k + ncols >= len(curve_list):  # nothing drawn below it: its own x tick labels
            ax.xaxis.set_tick_params(labelbottom=True)
    if ys:
        margin = max(0.01, 0.05 * (max(ys) - min(ys)))
        axes[0, 0].set_ylim(max(0.0, min(ys) - margin), min(1.0, max(ys) + margin))
    if x == "iterations":
        axes[0, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.supxlabel(X_AXES[x], fontsize=9)
    fig.supylabel("held-out success rate", fontsize=9)
    fig.tight_layout()
    return fig


def _table_lines(
    summaries: list[VariantSummary], warm: WarmStart | None, start: tuple[Pooled, int] | None = None
) -> list[str]:
    lines = [
        "| variant | seeds | final | best | AUC | change | env steps | tokens | wall time (s) | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    if warm is not None:
        low, high = wilson(warm.success, warm.episodes)
        lines.append(
            f"| warm start (`{warm.model_uri}`) | 1 | {warm.success:.3f} [{low:.3f}, {high:.3f}] | | | | | | | starting point |"
        )
    if start is not None:
        p, seeds = start
        low, high = wilson(p.rate, p.episodes)
        lines.append(
            f"| the same, as the cells first evaluated it | {seeds} | {p.rate:.3f} [{low:.3f}, {high:.3f}] | | | | | | | "
            f"each seed's first evaluation, pooled over {p.episodes:,} episodes |"
        )
    for s in summaries:
        cells = " | ".join([*(_ci(ci) for ci in (s.final, s.best, s.auc)), _ci(s.change, signed=True)])
        note = (
            f"⚠ {s.seeds} seed{'s' if s.seeds != 1 else ''}: too few to separate methods" if s.seeds < MIN_SEEDS else ""
        )
        lines.append(
            f"| {s.variant} | {s.seeds} | {cells} | {s.env_steps:,.0f} | {s.tokens:,.0f} | {s.train_s:,.0f} | {note} |"
        )
    return lines


def _family_lines(summaries: list[VariantSummary]) -> list[str]:
    """The final-success table by task family (none when no cell logged families)."""
    names = sorted({f for s in summaries for f in s.families})
    if not names:
        return []
    lines = ["## By task family", "", "| variant | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [
        f"| {s.variant} | " + " | ".join(_ci(s.families[f]) if f in s.families else "" for f in names) + " |"
        for s in summaries
    ]
    return lines + [
        "",
        "Final held-out success per task family: mean over seeds [95% percentile-bootstrap interval of the mean].",
        "",
    ]


def _separation_warnings(summaries: list[VariantSummary]) -> list[str]:
    """Which pairs of variants these seeds order by final success (``compare``), the higher first. Named
    rather than the pairs not told apart, which are most pairs in a study of many variants."""
    if len(summaries) < 2:
        return []
    verdicts = [(a.variant, b.variant, compare(a, b)) for i, a in enumerate(summaries) for b in summaries[i + 1 :]]
    ordered = [(a, b) if verdict == "above" else (b, a) for a, b, verdict in verdicts if verdict != "overlap"]
    total = len(summaries) * (len(summaries) - 1) // 2
    if not ordered:
        return [f"⚠ These seeds order none of the {total} pairs of variants by final success.", "", _ORDER_RULE, ""]
    return [
        f"⚠ These seeds order {len(ordered)} of the {total} pairs of variants by final success (higher first): "
        f"{'; '.join(f'{a} > {b}' for a, b in sorted(ordered))}. No other pair is told apart.",
        "",
        _ORDER_RULE,
        "",
    ]


_ORDER_RULE = (
    "Two variants are ordered when their final-success intervals over seeds are disjoint and, where the "
    "evaluations' episodes are counted, the 95% interval of the difference with every seed's episodes pooled "
    "(Newcombe) excludes 0 on the same side."
)


def _order(a: Interval, b: Interval) -> str:
    """``above`` / ``below`` when the intervals are disjoint, else ``overlap`` (also without intervals)."""
    if math.isnan(a.low) or math.isnan(b.low):
        return "overlap"
    if a.low > b.high:
        return "above"
    return "below" if a.high < b.low else "overlap"


def _pooled(p: PooledChange | None) -> str:
    if p is None:
        return "; no episode counts to pool"
    return f"; {_ci(p.change, signed=True)} pooled over {p.first_episodes:,} and {p.final_episodes:,} episodes"


def _ci(ci: Interval, signed: bool = False) -> str:
    f = "+.3f" if signed else ".3f"
    return f"{ci.mean:{f}}" if math.isnan(ci.low) else f"{ci.mean:{f}} [{ci.low:{f}}, {ci.high:{f}}]"


def _by_variant(cells: list[CellHistory]) -> dict[str, list[CellHistory]]:
    """Variants by name, each one's seeds in seed order: the page does not depend on the cells' order."""
    groups: dict[str, list[CellHistory]] = {}
    for c in cells:
        groups.setdefault(c.variant, []).append(c)
    return {v: sorted(groups[v], key=lambda c: c.seed) for v in sorted(groups)}
