"""Statistics of the sweep report: percentile-bootstrap intervals over seeds, paired differences (over
iterations, and over the held-out tasks a run's two ends share), Wilson's interval of a proportion and
Newcombe's interval of a difference of proportions. Pure numpy."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BOOTSTRAP = 10_000  # resamples of the seeds
Z_95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float  # 95% interval of the mean (NaN for one seed)
    high: float

    @property
    def half(self) -> float:
        """Half the interval's width (NaN for one seed)."""
        return (self.high - self.low) / 2


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


def paired_change(before: dict[str, list[float]], after: dict[str, list[float]]) -> tuple[Interval, int]:
    """Mean over tasks of ``mean(after[t]) - mean(before[t])`` (each task's success averaged over its
    samples), with the 95% percentile-bootstrap interval of that mean (resampling tasks), and how many tasks
    it used: those both sides played, in key order (the interval does not depend on the rows' order).

    Why: a run evaluates the same held-out tasks at its two ends, so each task's difference leaves out how
    hard the task is; Newcombe's interval treats the two rates as independent samples and is wider wherever
    tasks differ in difficulty (a task's two outcomes are then correlated). It is one seed's interval: the
    spread between seeds is not in it."""
    shared = sorted(before.keys() & after.keys())
    return interval([float(np.mean(after[t])) - float(np.mean(before[t])) for t in shared]), len(shared)


def wilson(p: float, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a success rate ``p`` over ``n`` episodes (inside [0, 1])."""
    if n <= 0:
        return float("nan"), float("nan")
    z = Z_95
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
