"""Step-level helpers shared by GiGPO and BLPO (Layout S, docs/algorithms.md §0.1, §0.4, §2.2, §4.3, §7.2).

Rows are decision steps, contiguous per trajectory and in turn order. Groups are integer codes
0..G-1 (one per distinct key), so every per-group statistic is a ``np.bincount`` over the rows, and
no Python loop runs per group. All arithmetic is float64 (7.5).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

try:  # the hash table pd.factorize uses for a column of str (pandas 2.2 - 3.1); optional
    from pandas._libs.hashtable import StringHashTable
except ImportError:  # pragma: no cover
    StringHashTable = None

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
    ids = traj[starts]
    if not np.all(ids[1:] > ids[:-1]) and len(starts) != len(distinct(ids)):  # increasing ids: distinct
        raise ValueError("StepBatch rows of a trajectory must be contiguous (traj_id repeats after a gap)")
    if np.any(same & (turn[1:] <= turn[:-1])):
        raise ValueError("StepBatch rows of a trajectory must be in increasing turn order")
    if np.any(same & (group[1:] != group[:-1])):
        raise ValueError("a trajectory's rows must share one group_id")
    return starts.astype(np.int64)


def discounted_returns(reward: np.ndarray, starts: np.ndarray, gamma: float) -> np.ndarray:
    """G_n = r_n + gamma * G_{n+1} inside each trajectory, G = 0 after its last row (2.2, 4.3).

    The recursion runs backwards over the distance d to the trajectory's end, vectorized over
    trajectories (one numpy step per d, over the trajectories longer than d), so it equals the plain
    loop bit for bit.

    Args:
        reward: (N,) step rewards r_n in row order.
        starts: (T,) first row of each trajectory (``trajectory_starts``).
        gamma: discount factor.

    Returns:
        (N,) float64 returns G_n.
    """
    n_rows = len(reward)
    returns = np.zeros(n_rows + 1, dtype=np.float64)  # last slot: G after the end = 0
    if n_rows == 0:
        return returns[:0]
    ends = np.append(starts[1:], n_rows) - 1  # (T,) last row of each trajectory
    returns[ends] = reward[ends] + gamma * returns[n_rows]  # the zero pad after the end
    lengths = ends - starts + 1
    small = np.int16 if int(lengths.max()) < np.iinfo(np.int16).max else np.int64
    longest = ends[np.argsort(-lengths.astype(small), kind="stable")]  # a radix sort: longest first
    longer = np.cumsum(np.bincount(lengths)[::-1])[::-1]  # longer[d]: trajectories of d rows or more
    for d in range(1, len(longer) - 1):  # row n = end - d, d rows before its trajectory's end
        rows = longest[: longer[d + 1]] - d
        returns[rows] = reward[rows] + gamma * returns[rows + 1]
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
    is a value like any other. A column of str only goes straight to the string table that
    ``pd.factorize`` would pick (``StringHashTable``: the same codes, without its NA and type scans,
    which cost a third as much again); anything else, or a pandas without it, through
    ``pd.factorize``. Numeric arrays use ``np.unique(return_inverse=True)`` over their runs of equal
    values (``_runs``: a task group's rows are one run, so 1e6 group ids are 1e5 values to sort).
    """
    if isinstance(values, np.ndarray) and values.dtype != object:
        flat, spread = _runs(values)
        uniques, codes = np.unique(flat, return_inverse=True)
        return spread(codes.reshape(-1).astype(np.int64)), uniques.tolist()
    items = values if isinstance(values, np.ndarray) else np.asarray(list(values), dtype=object)
    if StringHashTable is not None and items.ndim == 1 and len(items):
        try:
            uniques, codes = StringHashTable(len(items)).factorize(
                items, na_sentinel=-1, na_value=None, mask=None, ignore_na=False
            )
            return codes.astype(np.int64), list(uniques)
        except (TypeError, ValueError):  # a value that is not a str: pandas' general path
            pass
    codes, uniques = pd.factorize(items, use_na_sentinel=False)
    return codes.astype(np.int64), list(uniques)


def combine_codes(a: np.ndarray, b: np.ndarray, n_b: int) -> tuple[np.ndarray, int]:
    """Codes of the pairs (a_n, b_n), in sorted (a, b) order, and their number.

    ``b`` must lie in 0..n_b-1. Pairs are packed as a * n_b + b (int64) and coded by a count over
    the packed range when it is at most 4N (``dense_codes``), else with ``np.unique(return_inverse=True)``.
    """
    packed = _packed(a, b, n_b)
    if len(packed) and int(packed.max()) < DENSE_RANGE * len(packed):
        return dense_codes(packed)
    uniques, codes = np.unique(packed, return_inverse=True)
    return codes.reshape(-1).astype(np.int64), len(uniques)


def pair_codes(a: np.ndarray, b: np.ndarray, n_b: int) -> tuple[np.ndarray, int]:
    """Codes of the pairs (a_n, b_n) and their number, for groupings whose numbering no result
    depends on (per-group statistics summed in row order): ``combine_codes``' count over a small
    packed range; else, when every b code occurs with one a only, b's own codes (renumbered in
    order if some go unused: a scatter and a check instead of hashing 1e6 pairs); else pandas' hash
    table on the packed int64 (first-appearance order) instead of a sort. Codes of b numbered by
    first appearance stay so on the second path."""
    packed = _packed(a, b, n_b)
    if len(packed) and int(packed.max()) < DENSE_RANGE * len(packed):
        return dense_codes(packed)
    if len(packed) and int(np.min(a)) >= 0 and int(np.min(b)) >= 0:  # b determines a: the pairs are b's groups
        a_of_b = np.full(max(n_b, 1), -1, dtype=np.int64)
        a_of_b[b] = a
        if np.array_equal(a_of_b[b], a):  # each b code has one a (an anchor observation names its task)
            present = a_of_b >= 0
            if present.all():
                return np.asarray(b, dtype=np.int64), n_b
            rank = np.cumsum(present) - 1
            return rank[b].astype(np.int64), int(rank[-1]) + 1
    codes, uniques = pd.factorize(packed)
    return codes.astype(np.int64), len(uniques)


DENSE_RANGE = 4  # packed pair values below 4N are coded by a count, not a sort or a hash table


def _packed(a: np.ndarray, b: np.ndarray, n_b: int) -> np.ndarray:
    a = np.asarray(a, dtype=np.int64)
    if len(a) and int(a.max()) >= np.iinfo(np.int64).max // max(n_b, 1):
        raise ValueError("too many distinct keys to pack into int64 pair codes")
    return a * max(n_b, 1) + np.asarray(b, dtype=np.int64)


def dense_codes(packed: np.ndarray) -> tuple[np.ndarray, int]:
    """Codes of non-negative int64 values in sorted order, by a count over 0..max: what
    ``np.unique(return_inverse=True)`` gives, in O(N + max)."""
    present = np.zeros(int(packed.max()) + 1, dtype=bool)
    present[packed] = True
    rank = np.cumsum(present, dtype=np.int32 if len(present) < 2**31 else np.int64)  # half the bytes to gather
    return rank[packed].astype(np.int64) - 1, int(rank[-1])


def run_starts(values: np.ndarray) -> np.ndarray:
    """(R,) int64 index of the first row of each run of equal neighbours in a non-empty 1-D array."""
    new = np.empty(len(values), dtype=bool)
    new[0] = True
    np.not_equal(values[1:], values[:-1], out=new[1:])
    return np.flatnonzero(new)


def _runs(values: np.ndarray) -> tuple[np.ndarray, Any]:
    """The values of a numeric column's runs of equal neighbours, and a function spreading per-run
    codes back to rows. Coding the runs gives the rows' codes in the same order (sorted, or by first
    appearance) at a fraction of the cost when rows come in runs (a group's rows are contiguous);
    a column without runs is passed through as it is."""
    flat = np.asarray(values).reshape(-1)
    if len(flat) < 2:
        return flat, lambda codes: codes
    starts = run_starts(flat)
    if 2 * len(starts) > len(flat):
        return flat, lambda codes: codes
    lengths = np.diff(np.append(starts, len(flat)))
    return flat[starts], lambda codes: np.repeat(codes, lengths)


def hashed_codes(values: Any) -> tuple[np.ndarray, int]:
    """Integer codes of a column in first-appearance order and their number (``factorize`` without
    sorting numeric values: for groupings whose numbering no result depends on)."""
    if isinstance(values, np.ndarray) and values.dtype != object:
        flat, spread = _runs(values)
        codes, uniques = pd.factorize(flat)
        return spread(codes.astype(np.int64)), len(uniques)
    codes, uniques = factorize(values)
    return codes, len(uniques)


BLOCK_ROWS = 8192  # rows per block of ``codes_within_groups``: its hash tables stay in the CPU's cache


def codes_within_groups(values: Any, group: np.ndarray) -> tuple[np.ndarray, int]:
    """Codes of a column that only need to tell values apart inside each group (GiGPO's anchor
    observation inside its uid), and their number.

    When every group's rows are one contiguous run (the store's rollout order), the rows are cut
    into blocks of about ``BLOCK_ROWS`` at group boundaries and each block is coded by its own small
    hash table (a third cheaper on 1e6 strings than one table over all rows, whose probes miss the
    cache); codes are unique across blocks, so equal values in two blocks (then in two groups) get
    two codes. Otherwise, ``hashed_codes``. Pair the result with ``group`` (``pair_codes``).

    Args:
        group: (N,) int group codes.
    """
    values = values if isinstance(values, np.ndarray) else np.asarray(list(values), dtype=object)
    group = np.asarray(group)
    if values.dtype != object or values.ndim != 1 or len(values) < 4 * BLOCK_ROWS:
        return hashed_codes(values)
    starts = run_starts(group)
    if len(starts) != len(distinct(group[starts])):  # a group in two runs: one table over all rows
        return hashed_codes(values)
    at = np.searchsorted(starts, np.arange(0, len(values), BLOCK_ROWS))  # first group start at or after
    cuts = np.unique(np.append(starts[at[at < len(starts)]], len(values)))  # block bounds, from 0 to N
    codes = np.empty(len(values), dtype=np.int64)
    n_codes = 0
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        block, uniques = factorize(values[lo:hi])
        codes[lo:hi] = block + n_codes
        n_codes += len(uniques)
    return codes, n_codes


def group_first(codes: np.ndarray, n_groups: int) -> np.ndarray:
    """Row index of each group's first member, (G,) int64."""
    first = np.full(n_groups, len(codes), dtype=np.int64)
    np.minimum.at(first, codes, np.arange(len(codes), dtype=np.int64))
    return first


def first_rows(codes: np.ndarray) -> np.ndarray:
    """``group_first`` of codes numbered in first-appearance order (``pair_codes``, ``hashed_codes``):
    the rows where the running maximum grows, without a scatter."""
    grows = np.empty(len(codes), dtype=bool)
    if len(codes):
        peak = np.maximum.accumulate(codes)
        grows[0], grows[1:] = True, peak[1:] != peak[:-1]
    return np.flatnonzero(grows)


def group_moments(
    x: np.ndarray, codes: np.ndarray, n_groups: int, first: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """Per-group count, mean and unbiased variance (ddof = 1) of ``x`` (N,) over ``codes`` (N,).

    The mean is taken around the group's first value (mean = x_ref + mean(x - x_ref)), so a group of
    identical values has a mean equal to them and deviations of exactly 0 (7.2). The variance is the
    two-pass sum of squared deviations; it is 0 for groups of size 1. An empty ``x`` gives G groups of
    count 0, mean 0 and variance 0.

    Args:
        first: each group's first row, if known (``first_rows``; default ``group_first``).

    Returns:
        ``(count, mean, var)``, each (G,): int64, float64, float64.
    """
    count = np.bincount(codes, minlength=n_groups)
    if len(x) == 0:  # no member in any group (e.g. no progress-active row): count 0, mean 0, var 0
        return count, np.zeros(n_groups), np.zeros(n_groups)
    first = group_first(codes, n_groups) if first is None else first
    ref = x[np.minimum(first, len(x) - 1)]  # (G,) first value of each group
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
    first: np.ndarray | None = None,
) -> np.ndarray:
    """(x - mu_g) / (sigma_g + eps) (``mean_std_norm``) or x - mu_g (``mean_norm``) per group (0.4).

    mu and the unbiased sigma come from ``x`` grouped by ``codes``; they are applied to ``x_apply``
    grouped by ``codes_apply`` (default: ``x`` and ``codes`` themselves).

    Args:
        singleton: rule for a group of size 1: ``"zero"`` (mu = x, so A = 0: BLPO, GiGPO step term)
            or ``"raw"`` (mu = 0, sigma = 1, so A = x / (1 + eps): verl GRPO, GiGPO episode term).
        first: each group's first row in ``codes``, if known (``group_moments``).

    Returns:
        Standardized ``x_apply``, float64.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    count, mean, var = group_moments(x, codes, n_groups, first)
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
    return pair_codes(validity, text[raw], len(text_values))


@dataclass(frozen=True)
class StepKeys:
    """Integer codes of a batch's key columns (2.3, 2.4); ``*_values`` hold the distinct originals."""

    uid: np.ndarray  # (N,) task group, numbered in sorted order of the group ids
    n_uid: int
    obs: np.ndarray  # (N,) anchor observation
    n_obs: int
    exact: np.ndarray  # (N,) Exact group E = (uid, anchor_obs) (``pair_codes``: no order implied)
    n_exact: int
    exact_first: np.ndarray  # (n_exact,) first row of each Exact group
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
    _moments: dict = field(default_factory=dict, compare=False, repr=False)

    def exact_moments(self, x: np.ndarray) -> tuple[np.ndarray, ...]:
        """``group_moments`` of ``x`` over the Exact groups, computed once per array (the Exact and
        progress layers both centre the returns G in E)."""
        if id(x) not in self._moments or self._moments[id(x)][0] is not x:
            self._moments.clear()
            self._moments[id(x)] = x, group_moments(x, self.exact, self.n_exact, self.exact_first)
        return self._moments[id(x)][1]


def step_keys(batch: StepBatch) -> StepKeys:
    """Factorize every key column once; no Python loop runs per row (2.3). Pairs are coded by hash
    (``pair_codes``); where an order of summation depends on a numbering, the caller sorts by the
    columns' own codes (``sorted_exact``)."""
    uid, uid_values = factorize(batch.group_id)
    obs, obs_values = factorize(batch.anchor_obs)
    exact, n_exact = pair_codes(uid, obs, len(obs_values))
    action, n_action = canonical_action_codes(batch.action, batch.valid, batch.format_valid)
    role, role_values = factorize(batch.progress_key)
    abstract, abstract_values = factorize(batch.abstract_action)
    key, n_key = pair_codes(role, abstract, len(abstract_values))
    first = group_first(key, n_key)
    context, context_values = factorize(batch.context_id)
    return StepKeys(
        uid,
        len(uid_values),
        obs,
        len(obs_values),
        exact,
        n_exact,
        group_first(exact, n_exact),
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
