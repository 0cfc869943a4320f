"""Step-level helpers shared by GiGPO and BLPO (Layout S, docs/algorithms.md §0.1, §0.4, §2.2, §4.3, §7.2).

Rows are decision steps, contiguous per trajectory and in turn order. Groups are integer codes
0..G-1 (one per distinct key), so every per-group statistic is a ``np.bincount`` over the rows, and
no Python loop runs per group. All arithmetic is float64 (7.5).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from methods.types import StepBatch

MODES = ("mean_norm", "mean_std_norm")
VALIDITY = ("valid", "inadmissible", "format_invalid")  # first part of a canonical exact action (2.4)


def require_finite(batch: StepBatch, *names: str) -> None:
    """Raise ``ValueError`` naming the first float column that holds NaN or Inf (2.12)."""
    for name in names:
        values = np.asarray(getattr(batch, name), dtype=np.float64)
        if values.shape != (len(batch),):
            raise ValueError(f"StepBatch.{name} has shape {values.shape}, expected ({len(batch)},)")
        if not np.isfinite(values).all():
            raise ValueError(f"StepBatch.{name} contains NaN or Inf")


def penalized_score_and_reward(batch: StepBatch, invalid_penalty: float) -> tuple[np.ndarray, np.ndarray]:
    """Apply the verl-agent invalid-action penalty p to every row whose action is not valid (4.3, 2.10).

    score_n = R_n - p * (1 - valid_n)   (the episode score that the host puts on the step row)
    r'_n    = r_n - p * (1 - valid_n)   (the step reward that enters the discounted returns)

    Returns:
        ``(score, reward)``, both (N,) float64.
    """
    penalty = invalid_penalty * (~np.asarray(batch.valid, dtype=bool)).astype(np.float64)  # (N,)
    score = np.asarray(batch.episode_return, dtype=np.float64) - penalty
    reward = np.asarray(batch.reward, dtype=np.float64) - penalty
    return score, reward


def trajectory_starts(batch: StepBatch) -> np.ndarray:
    """First row of each trajectory, (T,) int64; checks the row layout that the returns assume.

    Raises:
        ValueError: a trajectory's rows are not contiguous, its turns do not increase, or it spans
            two task groups.
    """
    traj, turn, group = (np.asarray(c) for c in (batch.traj_id, batch.turn, batch.group_id))
    same = traj[1:] == traj[:-1]  # (N-1,) row n+1 continues row n's trajectory
    starts = np.flatnonzero(np.concatenate(([True], ~same))) if len(traj) else np.zeros(0, np.int64)
    if len(starts) != len(distinct(traj[starts])):
        raise ValueError("StepBatch rows of a trajectory must be contiguous (traj_id repeats after a gap)")
    if np.any(same & (turn[1:] <= turn[:-1])):
        raise ValueError("StepBatch rows of a trajectory must be in increasing turn order")
    if np.any(same & (group[1:] != group[:-1])):
        raise ValueError("a trajectory's rows must share one group_id")
    return starts.astype(np.int64)


def discounted_returns(reward: np.ndarray, starts: np.ndarray, gamma: float) -> np.ndarray:
    """G_n = r_n + gamma * G_{n+1} inside each trajectory, G = 0 after its last row (2.2, 4.3).

    The recursion runs backwards over the position inside the trajectory, vectorized over
    trajectories (one numpy step per position), so it equals the plain loop bit for bit.

    Args:
        reward: (N,) step rewards r_n in row order.
        starts: (T,) first row of each trajectory (``trajectory_starts``).
        gamma: discount factor.

    Returns:
        (N,) float64 returns G_n.
    """
    n_rows = len(reward)
    lengths = np.diff(np.append(starts, n_rows))  # (T,)
    pos = np.arange(n_rows) - np.repeat(starts, lengths)  # (N,) index inside the trajectory
    is_last = np.zeros(n_rows, dtype=bool)
    is_last[starts + lengths - 1] = True
    successor = np.where(is_last, n_rows, np.arange(n_rows) + 1)  # (N,) row n+1, or the zero pad
    order = np.argsort(pos, kind="stable")
    offsets = np.concatenate(([0], np.cumsum(np.bincount(pos, minlength=0))))
    returns = np.zeros(n_rows + 1, dtype=np.float64)  # last slot: G after the end = 0
    for j in range(len(offsets) - 2, -1, -1):
        rows = order[offsets[j] : offsets[j + 1]]
        returns[rows] = reward[rows] + gamma * returns[successor[rows]]
    return returns[:n_rows]


def distinct(codes: np.ndarray) -> np.ndarray:
    """Sorted distinct values of an integer array (sort based: numpy 2.4's hash-based ``np.unique``
    without ``return_inverse`` is several times slower on 1e6 rows)."""
    ordered = np.sort(codes)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if len(ordered) else ordered


def factorize(values: Any) -> tuple[np.ndarray, list[Any]]:
    """Integer codes (N,) int64 of any hashable column, and its distinct values.

    Object (string) columns and lists are coded in first-appearance order by pandas' hash table
    (C; about 3x faster than a dict pass over 1e6 strings, and much faster than sorting them); None
    is a value like any other. Numeric arrays use ``np.unique(return_inverse=True)``.
    """
    if isinstance(values, np.ndarray) and values.dtype != object:
        uniques, codes = np.unique(values, return_inverse=True)
        return codes.reshape(-1).astype(np.int64), uniques.tolist()
    items = values if isinstance(values, np.ndarray) else np.asarray(list(values), dtype=object)
    codes, uniques = pd.factorize(items, use_na_sentinel=False)
    return codes.astype(np.int64), list(uniques)


def combine_codes(a: np.ndarray, b: np.ndarray, n_b: int) -> tuple[np.ndarray, int]:
    """Codes of the pairs (a_n, b_n), in sorted (a, b) order, and their number.

    ``b`` must lie in 0..n_b-1. Pairs are packed as a * n_b + b (int64) and coded with
    ``np.unique(return_inverse=True)``.
    """
    a = np.asarray(a, dtype=np.int64)
    if len(a) and int(a.max()) >= np.iinfo(np.int64).max // max(n_b, 1):
        raise ValueError("too many distinct keys to pack into int64 pair codes")
    uniques, codes = np.unique(a * max(n_b, 1) + np.asarray(b, dtype=np.int64), return_inverse=True)
    return codes.reshape(-1).astype(np.int64), len(uniques)


def group_first(codes: np.ndarray, n_groups: int) -> np.ndarray:
    """Row index of each group's first member, (G,) int64."""
    first = np.full(n_groups, len(codes), dtype=np.int64)
    np.minimum.at(first, codes, np.arange(len(codes), dtype=np.int64))
    return first


def group_moments(x: np.ndarray, codes: np.ndarray, n_groups: int) -> tuple[np.ndarray, ...]:
    """Per-group count, mean and unbiased variance (ddof = 1) of ``x`` (N,) over ``codes`` (N,).

    The mean is taken around the group's first value (mean = x_ref + mean(x - x_ref)), so a group of
    identical values has a mean equal to them and deviations of exactly 0 (7.2). The variance is the
    two-pass sum of squared deviations; it is 0 for groups of size 1. An empty ``x`` gives G groups of
    count 0, mean 0 and variance 0.

    Returns:
        ``(count, mean, var)``, each (G,): int64, float64, float64.
    """
    count = np.bincount(codes, minlength=n_groups)
    if len(x) == 0:  # no member in any group (e.g. no progress-active row): count 0, mean 0, var 0
        return count, np.zeros(n_groups), np.zeros(n_groups)
    ref = x[np.minimum(group_first(codes, n_groups), len(x) - 1)]  # (G,) first value of each group
    safe = np.maximum(count, 1)
    mean = ref + np.bincount(codes, weights=x - ref[codes], minlength=n_groups) / safe
    dev = x - mean[codes]
    var = np.bincount(codes, weights=dev * dev, minlength=n_groups) / np.maximum(count - 1, 1)
    return count, mean, var


def group_standardize(
    x: np.ndarray,
    codes: np.ndarray,
    n_groups: int,
    mode: str,
    eps: float,
    singleton: str,
    x_apply: np.ndarray | None = None,
    codes_apply: np.ndarray | None = None,
) -> np.ndarray:
    """(x - mu_g) / (sigma_g + eps) (``mean_std_norm``) or x - mu_g (``mean_norm``) per group (0.4).

    mu and the unbiased sigma come from ``x`` grouped by ``codes``; they are applied to ``x_apply``
    grouped by ``codes_apply`` (default: ``x`` and ``codes`` themselves).

    Args:
        singleton: rule for a group of size 1: ``"zero"`` (mu = x, so A = 0: BLPO, GiGPO step term)
            or ``"raw"`` (mu = 0, sigma = 1, so A = x / (1 + eps): verl GRPO, GiGPO episode term).

    Returns:
        Standardized ``x_apply``, float64.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    count, mean, var = group_moments(x, codes, n_groups)
    std = np.sqrt(var)
    if singleton == "raw":
        mean = np.where(count == 1, 0.0, mean)
        std = np.where(count == 1, 1.0, std)
    elif singleton != "zero":
        raise ValueError(f"unknown singleton rule {singleton!r}")
    x_apply, codes_apply = (x, codes) if x_apply is None else (x_apply, codes_apply)
    dev = x_apply - mean[codes_apply]
    return dev if mode == "mean_norm" else dev / (std[codes_apply] + eps)


def center_active(
    adv: np.ndarray, active: np.ndarray, codes: np.ndarray, n_groups: int, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """Subtract from the active rows their group's mean; a group whose results are all <= eps in
    magnitude is set to 0 and deactivated (BLPO's current-batch role centering, 2.7 (h)).

    Returns:
        ``(adv, active)``, new (N,) arrays; inactive rows hold 0.
    """
    rows = np.flatnonzero(active)
    group = codes[rows]
    centered = adv[rows] - group_moments(adv[rows], group, n_groups)[1][group]
    alive = (np.bincount(group, weights=np.abs(centered) > eps, minlength=n_groups) > 0)[group]
    out_adv, out_active = np.zeros(len(adv)), np.zeros(len(adv), dtype=bool)
    out_adv[rows], out_active[rows] = np.where(alive, centered, 0.0), alive
    return out_adv, out_active


def normalize_action_text(text: object) -> str:
    """NFKC, strip, lower case, whitespace runs collapsed to one space (2.4)."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", str(text)).strip().lower())


def canonical_action_codes(action: Any, valid: Any, format_valid: Any) -> tuple[np.ndarray, int]:
    """Codes (N,) of the canonical exact action (validity, normalised text), and their number (2.4).

    validity indexes ``VALIDITY``: format_invalid when the action did not parse, else valid or
    inadmissible; the same text with another validity is another action. Each distinct raw string
    is normalised once.
    """
    raw, raw_values = factorize(action)
    text, text_values = factorize([normalize_action_text(v) for v in raw_values])
    fmt, ok = np.asarray(format_valid, dtype=bool), np.asarray(valid, dtype=bool)
    validity = np.where(~fmt, 2, np.where(ok, 0, 1))  # (N,)
    return combine_codes(validity, text[raw], len(text_values))


@dataclass(frozen=True)
class StepKeys:
    """Integer codes of a batch's key columns (2.3, 2.4); ``*_values`` hold the distinct originals."""

    uid: np.ndarray  # (N,) task group
    n_uid: int
    exact: np.ndarray  # (N,) Exact group E = (uid, anchor_obs)
    n_exact: int
    action: np.ndarray  # (N,) canonical exact action (validity, normalised text)
    n_action: int
    key: np.ndarray  # (N,) progress key (role, abstract action)
    key_role: np.ndarray  # (K,) role code of each key
    key_abstract: np.ndarray  # (K,) abstract-action code of each key
    role_values: list[str]
    abstract_values: list[str]
    context: np.ndarray  # (N,) exact child (context id)
    context_values: list[str]
    shareable: np.ndarray  # (N,) bool


def step_keys(batch: StepBatch) -> StepKeys:
    """Factorize every key column once; no Python loop runs per row except the dict pass (2.3)."""
    uid, uid_values = factorize(batch.group_id)
    obs, obs_values = factorize(batch.anchor_obs)
    exact, n_exact = combine_codes(uid, obs, len(obs_values))
    action, n_action = canonical_action_codes(batch.action, batch.valid, batch.format_valid)
    role, role_values = factorize(batch.progress_key)
    abstract, abstract_values = factorize(batch.abstract_action)
    key, n_key = combine_codes(role, abstract, len(abstract_values))
    first = group_first(key, n_key)
    context, context_values = factorize(batch.context_id)
    return StepKeys(
        uid,
        len(uid_values),
        exact,
        n_exact,
        action,
        n_action,
        key,
        role[first],
        abstract[first],
        [str(v) for v in role_values],
        [str(v) for v in abstract_values],
        context,
        context_values,
        np.asarray(batch.shareable, dtype=bool),
    )
