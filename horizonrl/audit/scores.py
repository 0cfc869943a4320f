"""Step 4 of the credit audit: every estimator's agreement with the Monte Carlo truth (docs/algorithms.md
§8.3-8.4), from the per-point table (one row per decision point: ``a_mc``, ``se``, ``q_mc``, ``a_half1``,
``a_half2``, ``anchor``, ``action``, and one column of per-turn advantages per estimator).

An estimator whose column is NaN at some points (defined only where its own decision points fall: APPO's
branches) is scored on the points where it is defined, and is left out of the paired differences, which
compare estimators over the very same points.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd

from horizonrl.audit.statistics import (
    Estimate,
    agreement,
    bootstrap_means,
    bootstrap_spearman,
    interval,
    ordering_pairs,
    significant,
    spearman_brown,
)

METRICS = ("spearman", "sign_agreement", "ordering")


def score(table: pd.DataFrame, names: list[str], resamples: int, seed: int, z: float) -> dict:
    """The audit's figures: the noise ceiling, each estimator's three metrics with intervals, and each
    pair's paired difference. Points whose Monte Carlo advantage could not be estimated are left out.

    Returns:
        ``{"points", "points_nonzero", "noise_ceiling", "max_correlation", "estimators": {name: {metric: Estimate}},
        "pairs": [{"a", "b", "metric", "difference": Estimate}]}``.
    """
    table = table[np.isfinite(table["a_mc"].to_numpy(float))].reset_index(drop=True)
    paired = [n for n in names if np.isfinite(table[n].to_numpy(float)).all()]
    own = [n for n in names if n not in paired]
    estimators: dict[str, dict[str, Estimate]] = {}
    samples = _metrics(table, paired, resamples, seed, z, estimators)
    for name in own:
        part = table[np.isfinite(table[name].to_numpy(float))].reset_index(drop=True)
        _metrics(part, [name], resamples, seed, z, estimators)
    ceiling = noise_ceiling(table, resamples, seed)
    return {
        "points": len(table),
        "points_nonzero": int((table["a_mc"] != 0).sum()),  # the rest tie at 0: every continuation ended alike
        "noise_ceiling": ceiling,
        "max_correlation": math.sqrt(ceiling.value) if ceiling.value > 0 else float("nan"),
        "estimators": {name: estimators[name] for name in names},
        "pairs": pair_differences(paired, estimators, samples),
    }


def noise_ceiling(table: pd.DataFrame, resamples: int, seed: int) -> Estimate:
    """Spearman's correlation of the two halves' A_MC, Spearman-Brown corrected (§8.3), with its interval
    over resamples of the points."""
    half1, half2 = (table[c].to_numpy(float) for c in ("a_half1", "a_half2"))
    ok = np.isfinite(half1) & np.isfinite(half2)
    full, boot = bootstrap_spearman(half1[ok][None, :], half2[ok], resamples, seed)
    return interval(spearman_brown(float(full[0])), spearman_brown(boot[:, 0]), int(ok.sum()))


def _metrics(
    table: pd.DataFrame, names: list[str], resamples: int, seed: int, z: float, out: dict
) -> dict[str, np.ndarray]:
    """Each metric of ``names`` over ``table``'s points into ``out``; returns the (B, E) resampled values."""
    est = np.stack([table[n].to_numpy(float) for n in names]) if names else np.zeros((0, len(table)))
    a_mc, se, q_mc = (table[c].to_numpy(float) for c in ("a_mc", "se", "q_mc"))
    sign = significant(a_mc, se, z)
    pairs = ordering_pairs(table["anchor"].to_numpy(), table["action"].to_numpy(), q_mc)
    i, j = pairs[:, 0], pairs[:, 1]
    results = {
        "spearman": (bootstrap_spearman(est, a_mc, resamples, seed), len(a_mc)),
        "sign_agreement": (
            bootstrap_means(agreement(est[:, sign], a_mc[sign]), np.flatnonzero(sign), resamples, seed),
            int(sign.sum()),
        ),
        "ordering": (
            bootstrap_means(
                agreement(est[:, i] - est[:, j], q_mc[i] - q_mc[j]), table["anchor"].to_numpy()[i], resamples, seed
            ),
            len(pairs),
        ),
    }
    for k, name in enumerate(names):
        out[name] = {m: interval(full[k], boot[:, k], n) for m, ((full, boot), n) in results.items()}
    return {m: boot for m, ((_, boot), _) in results.items()}


def pair_differences(names: list[str], estimators: dict, samples: dict[str, np.ndarray]) -> list[dict]:
    """Every pair (a, b) of ``names`` and metric: a's figure less b's, with the interval of that difference
    over the same resamples (paired: the same points, or the same anchor states)."""
    out = []
    for (ka, a), (kb, b) in itertools.combinations(enumerate(names), 2):
        for metric in METRICS:
            ea, eb = estimators[a][metric], estimators[b][metric]
            boot = samples[metric][:, ka] - samples[metric][:, kb]
            out.append({"a": a, "b": b, "metric": metric, "difference": interval(ea.value - eb.value, boot, ea.n)})
    return out
