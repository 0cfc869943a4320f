"""Trajectory-level advantage estimators: LOOP, GRPO, Dr.GRPO, RLOO and REINFORCE++-baseline.

docs/algorithms.md §1.3–1.4 (LOOP) and §4 items 1, 2, 5 (the verl baselines), with the group conventions of
§0.4. Every estimator reads ``episode_return`` only (one return R_j per trajectory; the per-step
``reward`` is ignored), computes group statistics over TRAJECTORIES (one value per ``traj_id``, never
per row) and broadcasts the trajectory's advantage to all its rows.

Shapes: N rows, J trajectories, G groups, K_g trajectories in group g. All arithmetic is float64
(§7.5). Group deviations R_j − mean_g R are taken from a group pivot (the group's first return), so a
group whose returns are all equal gets exactly 0 (§7.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from methods.registry import ADVANTAGES
from methods.stepwise import run_starts
from methods.types import AdvantageResult, StepBatch


class _Trajectories(NamedTuple):
    """One value per trajectory, gathered from the rows of a ``StepBatch``."""

    row_traj: np.ndarray  # (N,) int64: trajectory index of each row, in [0, J)
    returns: np.ndarray  # (J,) float64: R_j
    group: np.ndarray  # (J,) int64: group index of each trajectory, in [0, G)
    group_size: np.ndarray  # (G,) int64: K_g, trajectories per group
    group_first: np.ndarray  # (G,) int64: first trajectory of each group
    run_length: np.ndarray | None  # (J,) int64 rows per trajectory when rows come sorted by traj_id, else None

    def to_rows(self, x: np.ndarray) -> np.ndarray:
        """(J,) values broadcast to their rows (N,): a repeat over sorted rows, else a gather."""
        return x[self.row_traj] if self.run_length is None else np.repeat(x, self.run_length)


def _first_and_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``np.unique(values, return_index=True, return_inverse=True)[1:]``: first row of each distinct
    value (sorted) and each row's code; third, the length of each value's run when the input is
    sorted (else None). Sorted input (the store's rollout order) takes a linear pass over runs
    instead of a sort, with the same result."""
    values = np.asarray(values)
    if len(values) and np.all(values[1:] >= values[:-1]):
        first = run_starts(values)
        length = np.diff(np.append(first, len(values)))
        return first, np.repeat(np.arange(len(first), dtype=np.int64), length), length
    _, first, codes = np.unique(values, return_index=True, return_inverse=True)
    return first, codes.reshape(-1), None


def _trajectories(batch: StepBatch) -> _Trajectories:
    """Collapse rows (N,) to trajectories (J,); raise if a trajectory's rows disagree on R or group."""
    first, row_traj, run_length = _first_and_codes(batch.traj_id)
    row_returns = np.asarray(batch.episode_return, dtype=np.float64)  # (N,)
    if not np.all(np.isfinite(row_returns)):
        raise ValueError("episode_return has non-finite values")
    returns = row_returns[first]  # (J,)
    row_group = np.asarray(batch.group_id)
    group_first, group, _ = _first_and_codes(row_group[first])
    traj = _Trajectories(row_traj, returns, group, np.bincount(group), group_first, run_length)
    if np.any(row_returns != traj.to_rows(returns)):
        raise ValueError("rows of one trajectory carry different episode_return values")
    if np.any(row_group != traj.to_rows(row_group[first])):
        raise ValueError("rows of one trajectory carry different group_id values")
    return traj


def _group_deviation(traj: _Trajectories) -> np.ndarray:
    """R_j − mean_g R, (J,); exactly 0 for a group whose returns are all equal (§7.2)."""
    shifted = traj.returns - traj.returns[traj.group_first][traj.group]  # 0 for every member of a tied group
    shifted_mean = np.bincount(traj.group, shifted, len(traj.group_size)) / traj.group_size
    return shifted - shifted_mean[traj.group]


def _group_std(dev: np.ndarray, traj: _Trajectories, ddof: int) -> np.ndarray:
    """Per-trajectory group std, (J,), from deviations (J,); ddof=1 unbiased, 0 population."""
    sum_sq = np.bincount(traj.group, dev * dev, len(traj.group_size))
    return np.sqrt(sum_sq / np.maximum(traj.group_size - ddof, 1))[traj.group]


def _result(traj: _Trajectories, adv: np.ndarray, keep: np.ndarray) -> AdvantageResult:
    """Broadcast (J,) advantages and keep flags to rows (N,) and fill the plain stats."""
    row_adv, row_keep = traj.to_rows(adv), traj.to_rows(keep)
    nonzero_per_group = np.bincount(traj.group, adv != 0, len(traj.group_size))
    n_groups = len(traj.group_size)
    stats = {
        "zero_group_fraction": float(np.mean(nonzero_per_group == 0)) if n_groups else 0.0,
        "kept_fraction": np.count_nonzero(row_keep) / len(row_keep) if len(row_keep) else 0.0,  # np.mean's bits
        "adv_mean": float(np.mean(row_adv)) if len(row_adv) else 0.0,
        "adv_abs_mean": float(np.mean(np.abs(row_adv))) if len(row_adv) else 0.0,
        "groups": float(n_groups),
        "trajectories": float(len(traj.returns)),
    }
    return AdvantageResult(adv=row_adv, keep=row_keep, stats=stats)


def _keep_by_threshold(adv: np.ndarray, threshold: float, pos_adv_only: bool = False) -> np.ndarray:
    """The §1.4 filter, (J,) bool: |A| ≥ threshold, or A ≥ threshold with ``pos_adv_only``."""
    score = adv if pos_adv_only else np.abs(adv)
    return score >= threshold


@dataclass(frozen=True)
class LOOParams:
    """LOOP advantage and filter (docs/algorithms.md §1.3–1.4; ml-loop ``conf/rl/params/default.yaml``)."""

    baseline: Literal["leave_one_out", "leave_none_out"] = "leave_one_out"  # A = R − LOO mean, or R − mean
    normalize_std: bool = False  # divide by the group's population std, floored at 1e-7
    kl_lambda: float = 0.0  # ``rloo_kl_lambda``: constant added to every advantage, ≥ 0
    abs_adv_threshold: float = 0.01  # keep a trajectory when |A| ≥ this
    pos_adv_only: bool = False  # keep when A ≥ threshold instead of |A| ≥ threshold

    def __post_init__(self) -> None:
        if self.baseline not in ("leave_one_out", "leave_none_out"):
            raise ValueError(f"LOOParams.baseline must be leave_one_out or leave_none_out, got {self.baseline!r}")
        if self.kl_lambda < 0:
            raise ValueError(f"LOOParams.kl_lambda must be >= 0, got {self.kl_lambda}")


@ADVANTAGES.register("loo", LOOParams)
def loo_advantage(batch: StepBatch, params: LOOParams, state: object | None = None) -> AdvantageResult:
    """LOOP: A_k = R_k − (1/(K−1)) Σ_{i≠k} R_i = K/(K−1)·(R_k − mean R)  (docs/algorithms.md §1.3).

    ``baseline="leave_none_out"`` gives A_k = R_k − mean R. With ``normalize_std`` A is divided by the
    group's population std floored at 1e-7; then ``kl_lambda`` is added. keep = |A| ≥ threshold (or
    A ≥ threshold with ``pos_adv_only``), the §1.4 filter. The released code also rounds the kept count up
    to a multiple of the world size; with a single learner process that step is the identity and is
    not done here.

    Groups of size 1 (undefined: the released code asserts K ≥ 2): the docs/algorithms.md §6.8 default,
    advantage 0 and keep=False, whatever ``kl_lambda`` is.

    Args:
        batch: rows (N,); reads ``traj_id``, ``group_id``, ``episode_return``.
        params: see ``LOOParams``.
        state: unused (stateless).

    Returns:
        adv (N,) float64 and keep (N,) bool, equal on the rows of one trajectory.
    """
    traj = _trajectories(batch)
    dev = _group_deviation(traj)  # (J,)
    group_size = traj.group_size[traj.group].astype(np.float64)  # (J,) K
    single = group_size < 2
    if params.baseline == "leave_one_out":
        adv = dev * group_size / np.maximum(group_size - 1.0, 1.0)
    else:
        adv = dev
    if params.normalize_std:
        adv = adv / np.maximum(_group_std(dev, traj, ddof=0), 1e-7)
    adv = np.where(single, 0.0, adv + params.kl_lambda)
    keep = _keep_by_threshold(adv, params.abs_adv_threshold, params.pos_adv_only) & ~single
    return _result(traj, adv, keep)


@dataclass(frozen=True)
class GRPOParams:
    """GRPO outcome advantage (docs/algorithms.md §4.1; verl ``compute_grpo_outcome_advantage``)."""

    norm_by_std: bool = True  # divide by the unbiased group std + eps (False is Dr.GRPO)
    eps: float = 1e-6  # added to the std
    abs_adv_threshold: float = 0.0  # keep when |A| ≥ this; 0 keeps every row


def _grpo(traj: _Trajectories, norm_by_std: bool, eps: float) -> np.ndarray:
    """(R − mean_g R) / (std_g^unbiased R + eps), or without the division; size-1 rule of §7.1. (J,)."""
    dev = _group_deviation(traj)
    single = traj.group_size[traj.group] < 2
    if not norm_by_std:
        return np.where(single, traj.returns, dev)
    adv = dev / (_group_std(dev, traj, ddof=1) + eps)
    # verl sets mean := 0, std := 1 for a size-1 group, so A = R / (1 + eps)  (§7.1)
    return np.where(single, traj.returns / (1.0 + eps), adv)


@ADVANTAGES.register("grpo", GRPOParams)
def grpo_advantage(batch: StepBatch, params: GRPOParams, state: object | None = None) -> AdvantageResult:
    """GRPO: A_i = (R_i − mean_g R) / (std_g^unbiased R + ε)  (docs/algorithms.md §4.1, §0.4).

    A size-1 group keeps verl's mechanism (mean 0, std 1): A = R / (1 + ε), the "raw score" up to a
    relative 1e-6 (§7.1). ``norm_by_std=False`` drops the division (Dr.GRPO; size-1 gives A = R).

    Args:
        batch: rows (N,); reads ``traj_id``, ``group_id``, ``episode_return``.
        params: see ``GRPOParams``.
        state: unused (stateless).

    Returns:
        adv (N,) float64; keep (N,) = |A| ≥ ``abs_adv_threshold`` (all rows by default).
    """
    traj = _trajectories(batch)
    adv = _grpo(traj, params.norm_by_std, params.eps)
    return _result(traj, adv, _keep_by_threshold(adv, params.abs_adv_threshold))


@dataclass(frozen=True)
class DrGRPOParams:
    """Dr.GRPO outcome advantage (docs/algorithms.md §4.1; verl ``norm_adv_by_std_in_grpo = false``)."""

    abs_adv_threshold: float = 0.0  # keep when |A| ≥ this; 0 keeps every row


@ADVANTAGES.register("drgrpo", DrGRPOParams)
def drgrpo_advantage(batch: StepBatch, params: DrGRPOParams, state: object | None = None) -> AdvantageResult:
    """Dr.GRPO: A_i = R_i − mean_g R; a size-1 group gives A = R  (docs/algorithms.md §4.1).

    Args:
        batch: rows (N,); reads ``traj_id``, ``group_id``, ``episode_return``.
        params: see ``DrGRPOParams``.
        state: unused (stateless).

    Returns:
        adv (N,) float64; keep (N,) = |A| ≥ ``abs_adv_threshold`` (all rows by default).
    """
    traj = _trajectories(batch)
    adv = _grpo(traj, norm_by_std=False, eps=0.0)
    return _result(traj, adv, _keep_by_threshold(adv, params.abs_adv_threshold))


@dataclass(frozen=True)
class RLOOParams:
    """RLOO outcome advantage (docs/algorithms.md §4.2; verl ``compute_rloo_outcome_advantage``)."""

    abs_adv_threshold: float = 0.0  # keep when |A| ≥ this; 0 keeps every row


@ADVANTAGES.register("rloo", RLOOParams)
def rloo_advantage(batch: StepBatch, params: RLOOParams, state: object | None = None) -> AdvantageResult:
    """RLOO: A_i = R_i − (1/(G−1)) Σ_{j≠i} R_j = G/(G−1)·(R_i − mean_g R)  (docs/algorithms.md §4.2).

    A size-1 group gives A = R, as verl's loop version (§4.2), not its vectorized one (§7.6). Unlike
    "loo" there is no default filter.

    Args:
        batch: rows (N,); reads ``traj_id``, ``group_id``, ``episode_return``.
        params: see ``RLOOParams``.
        state: unused (stateless).

    Returns:
        adv (N,) float64; keep (N,) = |A| ≥ ``abs_adv_threshold`` (all rows by default).
    """
    traj = _trajectories(batch)
    group_size = traj.group_size[traj.group].astype(np.float64)  # (J,) G
    dev = _group_deviation(traj)
    adv = np.where(group_size < 2, traj.returns, dev * group_size / np.maximum(group_size - 1.0, 1.0))
    return _result(traj, adv, _keep_by_threshold(adv, params.abs_adv_threshold))


@dataclass(frozen=True)
class ReinforcePPBaselineParams:
    """REINFORCE++-baseline (docs/algorithms.md §4.5; verl ``compute_reinforce_plus_plus_baseline_...``)."""

    eps: float = 1e-8  # inside the square root of the whitening, as verl's ``masked_whiten``
    abs_adv_threshold: float = 0.0  # keep when |A| ≥ this; 0 keeps every row


@ADVANTAGES.register("reinforce_pp_baseline", ReinforcePPBaselineParams)
def reinforce_pp_baseline_advantage(
    batch: StepBatch, params: ReinforcePPBaselineParams, state: object | None = None
) -> AdvantageResult:
    """REINFORCE++-baseline: a_i = R_i − mean_g R, then A = (a − μ)/sqrt(σ² + eps)  (docs/algorithms.md §4.5).

    μ and σ² are the mean and the unbiased (Bessel) variance over all policy TOKENS of the batch: row n
    weighs ``n_tokens[n]`` (verl's ``masked_whiten`` over the response mask). A size-1 group has
    mean := 0, so a = R before whitening (verl's rule). The whitening is global, so an all-equal group
    gets −μ/σ, not 0, and the advantages of one group depend on the other groups.

    Args:
        batch: rows (N,); reads ``traj_id``, ``group_id``, ``episode_return``, ``n_tokens``.
        params: see ``ReinforcePPBaselineParams``.
        state: unused (stateless).

    Returns:
        adv (N,) float64; keep (N,) = |A| ≥ ``abs_adv_threshold`` (all rows by default).

    A batch with fewer than 2 policy tokens (the unbiased variance is undefined: one token, or an empty
    batch when every episode errored) gets A = 0: nothing to compare against, so no signal.
    """
    traj = _trajectories(batch)
    dev = _grpo(traj, norm_by_std=False, eps=0.0)[traj.row_traj]  # (N,) a, broadcast to rows
    weight = np.asarray(batch.n_tokens, dtype=np.float64)  # (N,)
    total = weight.sum()
    if total < 2:
        adv = np.zeros(len(traj.returns))
        return _result(traj, adv, _keep_by_threshold(adv, params.abs_adv_threshold))
    shifted = dev - dev[np.argmax(weight > 0)]  # pivot on a row with tokens: all-equal a gives 0
    centered = shifted - np.dot(weight, shifted) / total
    var = np.dot(weight, centered * centered) / (total - 1.0)
    row_adv = centered / np.sqrt(var + params.eps)  # (N,)
    # rows of one trajectory carry one value; gather it back to (J,) for the shared stats
    _, first = np.unique(traj.row_traj, return_index=True)
    adv = row_adv[first]
    return _result(traj, adv, _keep_by_threshold(adv, params.abs_adv_threshold))
