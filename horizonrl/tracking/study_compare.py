"""Methods compared task by task: the figures of a study's page, from its record (``study_record``) alone.

Within a seed every cell starts from the same warm start and ends on the same held-out tasks, so two methods'
final outcomes can be paired by task: the difference of each task's success leaves out how hard the task is.
Per pair of methods and per seed: the mean paired difference with its 95% percentile-bootstrap interval over
tasks (as ``stats.paired_change``) and McNemar's exact test on the tasks the two disagree on. Pooled: the same
over every (seed, task). A pair is told apart only when every seed's interval and the pooled one exclude 0 on
the same side; the spread between seeds is shown beside the paired figures, which are each one seed's noise.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from horizonrl.tracking.stats import Z_95, Interval, interval

Z_80 = 0.8416212335729143  # 80% power
CLAIMS = (  # (method claimed better, than, the claim as the study tests it)
    ("loop", "grpo", "LOOP: its leave-one-out PPO trains long-horizon agents better than GRPO-style baselines"),
    ("blpo", "gigpo", "BLPO: beats GiGPO at a matched budget (ALFWorld, WebShop)"),
    ("blpo", "grpo", "BLPO: beats GRPO at a matched budget (ALFWorld, WebShop)"),
    ("appo", "grpo", "APPO: about 4 points above its GRPO baseline (tool use)"),
)


@dataclass(frozen=True)
class SeedPair:
    seed: int
    differences: tuple[float, ...]  # success(a) - success(b) on each task both played, in task order
    change: Interval  # their mean, 95% bootstrap interval over tasks

    @property
    def tasks(self) -> int:
        return len(self.differences)

    @property
    def a_only(self) -> int:
        """Tasks a won and b lost (one sample each)."""
        return sum(d > 0 for d in self.differences)

    @property
    def b_only(self) -> int:
        return sum(d < 0 for d in self.differences)

    @property
    def mcnemar_p(self) -> float:
        return mcnemar_p(self.a_only, self.b_only)

    @property
    def sd(self) -> float:
        """Standard deviation of the per-task differences (0 for one task)."""
        return float(np.std(self.differences, ddof=1)) if self.tasks > 1 else 0.0


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    seeds: list[SeedPair]
    pooled: Interval
    pooled_tasks: int

    @property
    def verdict(self) -> str:
        """``a > b``, ``b > a`` or ``not told apart``: told apart only when every seed and the pool agree."""
        intervals = [s.change for s in self.seeds] + [self.pooled]
        if len(self.seeds) >= 1 and all(i.low > 0 for i in intervals):
            return f"{self.a} > {self.b}"
        if len(self.seeds) >= 1 and all(i.high < 0 for i in intervals):
            return f"{self.b} > {self.a}"
        return "not told apart"

    @property
    def seed_spread(self) -> float:
        """Largest minus smallest of the seeds' paired means (NaN for one seed)."""
        means = [s.change.mean for s in self.seeds]
        return max(means) - min(means) if len(means) > 1 else float("nan")


def finished_finals(outcomes: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """The last evaluation of every finished cell: seed, method, task, won (mean over samples)."""
    done = cells[(cells["status"] == "FINISHED") & (cells["method"] != "warmstart")][["seed", "method"]]
    o = outcomes.merge(done, on=["seed", "method"])
    last = o.groupby(["seed", "method"])["iteration"].transform("max")
    return o[o["iteration"] == last].groupby(["seed", "method", "task"], as_index=False)["won"].mean()


@dataclass(frozen=True)
class Start:
    """A cell's starting evaluation against its seed's first: the tasks both played and how many differ (in
    outcome or number of turns). Cells of one seed start from one warm start, so none should."""

    seed: int
    method: str
    first: str
    tasks: int
    differ: int


def starts(outcomes: pd.DataFrame, cells: pd.DataFrame) -> list[Start]:
    """Every cell's iteration-0 outcomes against those of its seed's first cell (in ``cells`` order) that has
    them. Equal outcomes are what a shared start plays; a cell that differs started from other weights (a warm
    start trained again elsewhere that came out different), and its pairs compare different starts."""
    zero = outcomes[outcomes["iteration"] == 0].set_index("task")
    out = []
    for seed in sorted(int(s) for s in cells["seed"].unique()):
        methods = [m for m in cells[cells["seed"] == seed]["method"] if m != "warmstart"]
        played = {m: t for m in methods if not (t := zero[(zero["seed"] == seed) & (zero["method"] == m)]).empty}
        if not played:
            continue
        first, *rest = played
        for m in rest:
            shared = played[first].index.intersection(played[m].index)
            a, b = (played[x].loc[shared, ["won", "turns"]].sort_index() for x in (first, m))
            out.append(Start(seed, m, first, len(shared), int((a != b).any(axis=1).sum())))
    return out


def mcnemar_p(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value: the discordant tasks split as a binomial(a_only + b_only, 1/2)."""
    n, k = a_only + b_only, min(a_only, b_only)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def seed_pair(finals: pd.DataFrame, seed: int, a: str, b: str) -> SeedPair | None:
    """Methods ``a`` and ``b`` of ``seed`` paired by task; None unless both finished."""
    side = {m: finals[(finals["seed"] == seed) & (finals["method"] == m)].set_index("task")["won"] for m in (a, b)}
    if side[a].empty or side[b].empty:
        return None
    shared = side[a].index.intersection(side[b].index)
    d = tuple((side[a][shared] - side[b][shared]).sort_index().tolist())  # in task order: the interval's draws
    return SeedPair(seed, d, interval(d))


def pairs(finals: pd.DataFrame, methods: list[str]) -> list[Pair]:
    """Every pair of ``methods`` (in that order) with at least one seed where both finished; pooled over the
    seeds' per-task differences."""
    out = []
    for a, b in itertools.combinations(methods, 2):
        seeds = [p for s in sorted(finals["seed"].unique()) if (p := seed_pair(finals, int(s), a, b)) is not None]
        if seeds:
            pooled = [d for p in seeds for d in p.differences]
            out.append(Pair(a, b, seeds, interval(pooled), len(pooled)))
    return out


def detectable(sd: float, n: int) -> float:
    """The smallest true paired difference a two-sided 5% test over ``n`` tasks finds with 80% power, for
    per-task differences of standard deviation ``sd`` (normal approximation)."""
    return (Z_95 + Z_80) * sd / math.sqrt(n) if n > 0 else float("nan")


def power(pair_list: list[Pair]) -> tuple[float, float, int, int]:
    """(detectable difference in one seed, pooled over the seeds), and the task counts behind them, from the
    per-task differences' standard deviation pooled over every pair and seed."""
    sds = [(s.sd, s.tasks) for p in pair_list for s in p.seeds if s.tasks > 1]
    if not sds:
        return float("nan"), float("nan"), 0, 0
    sd = math.sqrt(sum(v * v * (n - 1) for v, n in sds) / sum(n - 1 for _, n in sds))
    per_seed = int(np.median([n for _, n in sds]))
    pooled = int(np.median([p.pooled_tasks for p in pair_list]))
    return detectable(sd, per_seed), detectable(sd, pooled), per_seed, pooled


def claim_verdict(pair_list: list[Pair], better: str, than: str) -> tuple[str, Pair | None]:
    """What the study says of the claim ``better`` > ``than``: agrees, disagrees, not told apart, or not
    measured (one of the two has no finished cell), with the pair behind it."""
    for p in pair_list:
        if {p.a, p.b} == {better, than}:
            if p.verdict == "not told apart":
                return "not told apart at this size", p
            return ("agrees" if p.verdict == f"{better} > {than}" else "disagrees"), p
    return "not measured", None


def pair_figures(outcomes: pd.DataFrame, cells: pd.DataFrame) -> dict[str, float]:
    """Each pair's pooled paired difference and verdict (1: the first better, -1: the second, 0: not told
    apart) as ``<a>-vs-<b>/<figure>``: what a sweep's parent run shows of the task-by-task comparison."""
    methods = [m for m in dict.fromkeys(cells["method"]) if m != "warmstart"]
    figures = {}
    for p in pairs(finished_finals(outcomes, cells), methods):
        sign = {f"{p.a} > {p.b}": 1.0, f"{p.b} > {p.a}": -1.0}.get(p.verdict, 0.0)
        figures |= {
            f"{p.a}-vs-{p.b}/paired_mean": p.pooled.mean,
            f"{p.a}-vs-{p.b}/paired_low": p.pooled.low,
            f"{p.a}-vs-{p.b}/paired_high": p.pooled.high,
            f"{p.a}-vs-{p.b}/verdict": sign,
        }
    return figures
