"""The credit audit's statistics (docs/algorithms.md §8.2-8.4): the Monte Carlo advantage and its standard
error, the noise ceiling, and the three agreements of an estimator with the Monte Carlo truth, with
percentile-bootstrap intervals. Pure numpy and scipy: arrays in, numbers out.

Notation: P decision points, M continuations per arm, E estimators, B bootstrap resamples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata


@dataclass(frozen=True)
class Estimate:
    """A figure, its 95% percentile-bootstrap interval (NaN where too few units) and the units it rests on."""

    value: float
    low: float
    high: float
    n: int

    def excludes_zero(self) -> bool:
        return bool(self.low > 0 or self.high < 0)

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high, "n": self.n}


def mc_advantage(q: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(Q, V, A_MC = Q - V, its standard error) per point from the returns of the continuations (§8.2).

    Args:
        q: (P, M) returns from s_t with a_t fixed; NaN where a continuation failed.
        v: (P, M) returns from s_t with a fresh action.

    Returns:
        Four (P,) arrays. SE = sqrt(s_Q^2 / M_Q + s_V^2 / M_V) with unbiased variances; NaN where an arm has
        fewer than two returns.
    """
    q_mc, v_mc = _nanmean(q), _nanmean(v)
    se = np.sqrt(_nanvar(q) / _count(q) + _nanvar(v) / _count(v))
    return q_mc, v_mc, q_mc - v_mc, se


def split_halves(q: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A_MC of each half of the continuations, (P,) each: even columns of both arms, then odd ones (§8.3)."""
    return _nanmean(q[:, 0::2]) - _nanmean(v[:, 0::2]), _nanmean(q[:, 1::2]) - _nanmean(v[:, 1::2])


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation of two (P,) arrays (ties take their mean rank); NaN if either is constant
    or P < 2."""
    return float(spearman_rows(np.asarray(x, float)[None, :], np.asarray(y, float)[None, :])[0])


def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's correlation of each row of two (B, P) arrays, (B,); NaN where a row is constant."""
    rx, ry = (rankdata(a, axis=1) for a in (x, y))
    rx, ry = rx - rx.mean(axis=1, keepdims=True), ry - ry.mean(axis=1, keepdims=True)
    denominator = np.sqrt((rx * rx).sum(axis=1) * (ry * ry).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, (rx * ry).sum(axis=1) / denominator, np.nan)


def spearman_brown(r: float | np.ndarray) -> float | np.ndarray:
    """The reliability of the whole from the correlation ``r`` of its two halves: 2r / (1 + r) (§8.3); elementwise
    over an array, NaN staying NaN."""
    x = np.asarray(r, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(x <= -1, -1.0, 2 * x / (1 + x))
    return float(out) if out.ndim == 0 else out


def agreement(estimate: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Per entry: 1 where ``estimate`` has the sign of ``truth``, 0 where the opposite, 0.5 where the estimate
    is exactly 0 (it says nothing: a coin's rate). ``truth`` is nonzero."""
    return np.where(estimate == 0, 0.5, (np.sign(estimate) == np.sign(truth)).astype(float))


def significant(a_mc: np.ndarray, se: np.ndarray, z: float) -> np.ndarray:
    """(P,) bool: points whose Monte Carlo advantage is farther than ``z`` standard errors from 0."""
    return np.isfinite(a_mc) & np.isfinite(se) & (np.abs(a_mc) > z * se)


def ordering_pairs(anchor: np.ndarray, action: np.ndarray, q_mc: np.ndarray) -> np.ndarray:
    """(K, 2) point pairs i < j of one anchor state (``anchor`` >= 0, equal) left by different actions whose
    Monte Carlo values differ (a tie orders nothing), in order of i then j (§8.4)."""
    pairs = [
        (i, j)
        for i in range(len(anchor))
        for j in range(i + 1, len(anchor))
        if anchor[i] >= 0 and anchor[i] == anchor[j] and action[i] != action[j] and q_mc[i] != q_mc[j]
    ]
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)


def bootstrap_means(
    scores: np.ndarray, units: np.ndarray, resamples: int, seed: int, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A (weighted) mean of per-item scores, full sample and over resamples of ``units``.

    Args:
        scores: (E, K) each estimator's score of each item (a point, a pair of points).
        units: (K,) int: the unit each item belongs to (resampled whole: a point, an anchor state).
        resamples: B.
        seed: fixes the resamples; the same for every estimator, so their differences are paired.
        weights: (K,) item weights (default 1).

    Returns:
        ((E,) full-sample means, (B, E) resampled means).
    """
    w = np.ones(scores.shape[1]) if weights is None else np.asarray(weights, float)
    codes, unit = np.unique(units, return_inverse=True)
    unit_sum = np.stack([np.bincount(unit, weights=w * s, minlength=len(codes)) for s in scores])  # (E, U)
    unit_w = np.bincount(unit, weights=w, minlength=len(codes))  # (U,)
    full = unit_sum.sum(axis=1) / unit_w.sum() if len(codes) else np.full(len(scores), np.nan)
    if not len(codes):
        return full, np.full((resamples, len(scores)), np.nan)
    idx = np.random.default_rng(seed).integers(0, len(codes), size=(resamples, len(codes)))  # (B, U)
    return full, (unit_sum[:, idx].sum(axis=2) / unit_w[idx].sum(axis=1)).T


def bootstrap_spearman(
    estimates: np.ndarray, a_mc: np.ndarray, resamples: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Spearman's correlation of each estimator's (E, P) ``estimates`` with (P,) ``a_mc``, full sample (E,) and
    over resamples of the points (B, E), the same resamples for every estimator."""
    full = np.array([spearman(e, a_mc) for e in estimates]) if len(estimates) else np.zeros(0)
    if len(a_mc) < 2:
        return full, np.full((resamples, len(estimates)), np.nan)
    idx = np.random.default_rng(seed).integers(0, len(a_mc), size=(resamples, len(a_mc)))  # (B, P)
    return full, np.stack([spearman_rows(e[idx], a_mc[idx]) for e in estimates], axis=1)


DEFINED_SHARE = 0.95
"""The share of resamples a figure must be defined in (a Spearman correlation is not where a resample's A_MC is
constant) for its interval to be given: percentiles of the rest would describe only the resamples that happened
to hold the few informative points."""


def interval(value: float, samples: np.ndarray, n: int) -> Estimate:
    """``value`` with the 2.5th and 97.5th percentiles of its resampled ``samples`` (B,); NaN with fewer than
    two units or where fewer than ``DEFINED_SHARE`` of the resamples define it."""
    finite = samples[np.isfinite(samples)]
    if n < 2 or len(finite) < DEFINED_SHARE * len(samples) or not len(finite):
        return Estimate(float(value), float("nan"), float("nan"), int(n))
    low, high = np.percentile(finite, [2.5, 97.5])
    return Estimate(float(value), float(low), float(high), int(n))


def _count(x: np.ndarray) -> np.ndarray:
    return np.isfinite(x).sum(axis=1).astype(float)


def _nanmean(x: np.ndarray) -> np.ndarray:
    n = _count(x)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.nansum(x, axis=1) / n, np.nan)


def _nanvar(x: np.ndarray) -> np.ndarray:
    """Unbiased variance of each row's finite entries; NaN with fewer than two."""
    n = _count(x)
    dev = np.where(np.isfinite(x), x - _nanmean(x)[:, None], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 1, (dev * dev).sum(axis=1) / (n - 1), np.nan)
