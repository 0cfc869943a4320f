"""APPO: branching score, branch-point selection and the dual-group advantage (docs/algorithms.md §3.2–3.6).

Branching runs per initial rollout on arrays over its T_i policy tokens (BS = Z(H)·Z(Ω), §3.2), then
per task group (strict → fallback → cyclic, §3.3). The advantage normalises initial rollouts and branches
as separate groups and maps each branch's Â onto its parent's prefix (§3.5). The §3.7 loss lives in
``methods/appo_loss.py``; importing this module registers it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from methods.appo_loss import discounted_suffix_sum
from methods.registry import ADVANTAGES
from methods.types import AdvantageResult, StepBatch

OMEGA_FALLBACKS = ("entropy_only", "none")


def zscore(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Z(x)_t = (x_t − mean x) / (std_pop x + eps) over a (T,) array (§3.2).

    Deviations are taken from x shifted by its first element, so a constant input gives exact zeros
    (§7.2): the released code's ±1e-10 leftovers create spurious strict branch candidates.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return x.copy()
    shifted = x - x[0]
    dev = shifted - shifted.mean()
    return dev / (np.sqrt(np.mean(dev * dev)) + eps)


def entropy_zscore(entropy: np.ndarray) -> np.ndarray:
    """Z(H) over one rollout's policy tokens, (T,) → (T,) (§3.2; H from top-k log-probs, §6.5)."""
    return zscore(entropy)


def future_value(logp_cur: np.ndarray, logp_roll: np.ndarray, gamma: float = 1.0, eps_omega: float = 0.2) -> np.ndarray:
    """Ω_t = clip(exp(clamp(Σ_{k≥t} γ^{k−t} (logp_cur − logp_roll)_k, −20, 20)), 1 − ε_Ω, 1 + ε_Ω) (§3.2).

    ``logp_cur`` (T,) is the actor's recomputed log π_cur, ``logp_roll`` (T,) the sampler's; returns
    (T,) Ω. Distances k − t count policy tokens only (moot for the released γ = 1); ε_Ω ≤ 0 disables
    the clip, as in the code.
    """
    log_ratio = torch.as_tensor(np.asarray(logp_cur, np.float64) - np.asarray(logp_roll, np.float64))
    suffix = discounted_suffix_sum(log_ratio.reshape(1, -1), gamma)[0].numpy()
    omega = np.exp(np.clip(suffix, -20.0, 20.0))
    return np.clip(omega, 1.0 - eps_omega, 1.0 + eps_omega) if eps_omega > 0 else omega


@dataclass(frozen=True)
class BranchingParams:
    """Branching-score settings (§3.2, §6.4)."""

    gamma: float = 1.0  # γ of the future value (algorithm.gamma)
    eps_omega: float = 0.2  # ε_Ω = future_kl_clip_ratio
    omega_fallback: str = "entropy_only"  # Ω constant: BS = Z(H)·1[Z(H) > 0] (§6.4); "none": BS = 0

    def __post_init__(self) -> None:
        if self.omega_fallback not in OMEGA_FALLBACKS:
            raise ValueError(f"unknown omega_fallback {self.omega_fallback!r}; known: {OMEGA_FALLBACKS}")


class BranchingScore(NamedTuple):
    """Scores of one rollout's policy tokens, each (T,)."""

    bs: np.ndarray  # BS_t
    z_entropy: np.ndarray  # Z(H)_t
    z_omega: np.ndarray  # Z(Ω)_t (exact zeros when Ω is constant)
    omega_fallback: bool  # Ω was constant and BS fell back to Z(H)·1[Z(H) > 0]


def branching_score(
    entropy: np.ndarray, logp_cur: np.ndarray, logp_roll: np.ndarray, params: BranchingParams
) -> BranchingScore:
    """BS_t = Z(H)_t · Z(Ω)_t over one rollout, (T,) arrays in (§3.2).

    When Ω is constant (sampler and scorer are one policy, or Ω clipped to one bound everywhere),
    Z(Ω) ≡ 0. With ``omega_fallback="entropy_only"`` (default, §6.4) BS becomes Z(H) on positions with
    Z(H) > 0 and 0 elsewhere, and those positions count as strict in ``select_branch_points``; with
    ``"none"`` (code-faithful) BS = 0 and selection falls back to the earliest candidates (§3.11).
    """
    z_entropy = entropy_zscore(entropy)
    z_omega = zscore(future_value(logp_cur, logp_roll, params.gamma, params.eps_omega))
    if z_omega.size > 0 and not np.any(z_omega) and params.omega_fallback == "entropy_only":
        return BranchingScore(np.where(z_entropy > 0, z_entropy, 0.0), z_entropy, z_omega, True)
    return BranchingScore(z_entropy * z_omega, z_entropy, z_omega, False)


class BranchPoint(NamedTuple):
    """One selected split: the branch continues from prompt ⊕ response[: split + 1]."""

    rollout: int  # index of the initial rollout within its task group
    split: int  # s_b: split token index in that rollout's policy tokens (prefix includes it)
    score: float  # BS at the split
    how: str  # "strict" | "fallback" | "cyclic"


@dataclass(frozen=True)
class BranchSelection:
    """The branch points of one task group and how many came from each rule."""

    points: list[BranchPoint]
    counts: dict[str, int] = field(default_factory=dict)  # strict, fallback, cyclic (kept), dropped


def select_branch_points(
    scores: Sequence[BranchingScore],
    is_candidate: Sequence[np.ndarray],
    budget: int,
    max_split: Sequence[int] | None = None,
) -> BranchSelection:
    """Branch points of one task group, pooled over its K initial rollouts (§3.3).

    1. Candidates: policy positions with ``is_candidate`` (False for whitespace-only tokens).
    2. Strict: Z(H) > 0, Z(Ω) > 0 (or the rollout used the Ω fallback) and BS > 0; take the top B by BS.
    3. Fill with the highest-BS remaining candidates, then repeat the selection cyclically.
    Sorts are stable over (rollout, position) order, so ties take the earliest rollout, then position.
    4. Drop points with s > ``max_split[k]`` (prefix fills the response budget); the result may then hold
       fewer than B points, as in the released code. To refill instead, pass
       ``is_candidate & (arange(T_k) <= max_split[k])``.

    Args:
        scores: K BranchingScore records, one per initial rollout.
        is_candidate: K bool arrays (T_k,).
        budget: B, branches for this group.
        max_split: K largest allowed split indices, or None for no limit.
    """
    rollout, split, score, strict = _candidate_pool(scores, is_candidate)
    by_score = np.argsort(-score, kind="stable")
    strict_order = by_score[strict[by_score]][:budget]
    rest = by_score[~np.isin(by_score, strict_order)][: budget - strict_order.size]
    chosen = [BranchPoint(int(rollout[c]), int(split[c]), float(score[c]), "strict") for c in strict_order]
    chosen += [BranchPoint(int(rollout[c]), int(split[c]), float(score[c]), "fallback") for c in rest]
    if chosen:  # too few candidates (very short responses): repeat the selection in order
        chosen += [chosen[k % len(chosen)]._replace(how="cyclic") for k in range(budget - len(chosen))]
    kept = [p for p in chosen if max_split is None or p.split <= max_split[p.rollout]]
    counts = {how: sum(p.how == how for p in kept) for how in ("strict", "fallback", "cyclic")}
    counts["dropped"] = len(chosen) - len(kept)
    return BranchSelection(points=kept, counts=counts)


def _candidate_pool(
    scores: Sequence[BranchingScore], is_candidate: Sequence[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Flatten the group's candidates in (rollout, position) order → rollout, split, BS, strict (C,)."""
    parts = []
    for k, (sc, cand) in enumerate(zip(scores, is_candidate, strict=True)):
        pos = np.flatnonzero(np.asarray(cand, dtype=bool))
        omega_ok = np.ones(pos.size, bool) if sc.omega_fallback else sc.z_omega[pos] > 0
        strict = (sc.z_entropy[pos] > 0) & omega_ok & (sc.bs[pos] > 0)
        parts.append((np.full(pos.size, k), pos, np.asarray(sc.bs, np.float64)[pos], strict))
    if not parts:
        return np.zeros(0, int), np.zeros(0, int), np.zeros(0), np.zeros(0, bool)
    return tuple(np.concatenate(col) for col in zip(*parts))  # type: ignore[return-value]


def reward_scale_M(
    split: int, bs_over_max: float, length: int, kappa: float = 0.9, positions: np.ndarray | None = None
) -> np.ndarray:
    """M_b[t] = 1 + (BS_b / max BS) κ^{pos(s_b) − pos(t)} for t ≤ s_b, else 1; all ones if BS/max ≤ 0 (§3.6).

    ``positions`` (length,) are the response positions of the parent's action tokens (observation tokens
    between turns counted, as the released code's distance over the whole response); None: pos(t) = t.

    Returns:
        (length,) float64. Example: s = 3, BS/max = 0.5, κ = 0.9 → [1.3645, 1.405, 1.45, 1.5, 1, 1, …].
    """
    M = np.ones(length, dtype=np.float64)
    if bs_over_max <= 0:
        return M
    t = np.arange(min(split + 1, length))
    distance = split - t if positions is None else positions[split] - np.asarray(positions, np.int64)[t]
    M[t] = 1.0 + bs_over_max * kappa**distance
    return M


@dataclass(frozen=True)
class APPOParams:
    """Dual-group advantage settings (§3.5, §3.6, §6.3)."""

    norm_by_std: bool = True  # Â = (R − mean)/(std_pop + eps); False: R − mean
    eps: float = 1e-6
    reward_scale_M: bool = False  # code-faithful M on initial rows' step rewards before Â (§3.6; ~no-op)
    scale_token_advantages_by_M: bool = False  # §6.3 option: A_{i,t} *= mean_b M_b[t]
    reward_scale_discount: float = 0.9  # κ


class _Lineage(NamedTuple):
    """Trajectory table: J trajectories, indexed by their position in ``np.unique(traj_id)``."""

    row_traj: np.ndarray  # (N,) trajectory index j of each row
    first_row: np.ndarray  # (J,) first row of j
    start: np.ndarray  # (J,) flat index of j's first action token
    length: np.ndarray  # (J,) L_j: action tokens of j, all turns
    key: np.ndarray  # (J,) index of j's (group_id, kind) group
    is_branch: np.ndarray  # (J,) bool
    parent: np.ndarray  # (J,) parent trajectory index i_b, −1 for initial rollouts
    split: np.ndarray  # (J,) s_b over the parent's flat action tokens, −1 for initial rollouts


def _lineage(batch: StepBatch) -> _Lineage:
    """Build and check the trajectory table (rows contiguous, turns increasing, valid parents/splits)."""
    batch.require("kind", "parent_traj", "branch_token")
    ids, first, row_traj = np.unique(batch.traj_id, return_index=True, return_inverse=True)
    row_traj = row_traj.reshape(-1)
    same = np.diff(row_traj) == 0
    if np.count_nonzero(~same) + min(ids.size, 1) != ids.size or np.any(np.diff(batch.turn)[same] <= 0):
        raise ValueError("appo: rows of a trajectory must be contiguous and in turn order")
    n_tokens = batch.n_tokens.astype(np.int64)
    start = (np.cumsum(n_tokens) - n_tokens)[first]
    length = np.bincount(row_traj, weights=n_tokens, minlength=ids.size).astype(np.int64)
    kind = batch.kind[first].astype(np.int64)
    is_branch = kind == 1
    parent_id = batch.parent_traj[first]
    pos = np.clip(np.searchsorted(ids, parent_id), 0, ids.size - 1)
    parent = np.where(is_branch, pos, -1)
    split = np.where(is_branch, batch.branch_token[first], -1).astype(np.int64)
    p = parent[is_branch]
    if not np.all(np.isin(kind, (0, 1))) or np.any(ids[p] != parent_id[is_branch]) or np.any(is_branch[p]):
        raise ValueError("appo: kind must be 0/1 and every branch's parent_traj an initial rollout in the batch")
    if np.any(split[is_branch] < 0) or np.any(split[is_branch] >= length[p]):
        raise ValueError("appo: branch_token must index the parent's action tokens (0 <= s_b < L_parent)")
    _, key = np.unique(np.stack([batch.group_id[first], kind]), axis=1, return_inverse=True)
    return _Lineage(row_traj, first, start, length, key.reshape(-1), is_branch, parent, split)


def _group_zscore(values: np.ndarray, key: np.ndarray, eps: float, norm_by_std: bool) -> np.ndarray:
    """Â_j = (R_j − mean_G R)/(std_pop,G R + eps) over (J,) values; exact 0 for all-equal or size-1 G (§0.4)."""
    _, first, key = np.unique(key, return_index=True, return_inverse=True)
    count = np.bincount(key)
    shifted = values - values[first][key]  # deviations from a member: exact zeros for equal values (§7.2)
    dev = shifted - (np.bincount(key, weights=shifted) / count)[key]
    if not norm_by_std:
        return dev
    std = np.sqrt(np.bincount(key, weights=dev * dev) / count)
    return dev / (std[key] + eps)


def _branch_credit(lin: _Lineage, adv_hat: np.ndarray, n_flat: int) -> tuple[np.ndarray, np.ndarray]:
    """Σ_{b ∈ B_{i,t}} Â_b and |B_{i,t}| on the flat tokens (M,), B_{i,t} = {b: parent i, s_b ≥ t}."""
    credit_sum = np.zeros(n_flat)
    credit_count = np.zeros(n_flat, dtype=np.int64)
    for b in np.flatnonzero(lin.is_branch):  # per-branch slices: no cross-trajectory round-off
        lo = lin.start[lin.parent[b]]
        credit_sum[lo : lo + lin.split[b] + 1] += adv_hat[b]
        credit_count[lo : lo + lin.split[b] + 1] += 1
    return credit_sum, credit_count


def _token_positions(batch: StepBatch, lin: _Lineage, n_flat: int) -> np.ndarray:
    """Response position of each action token inside its trajectory, (M,): its index among the
    trajectory's action tokens plus the ``gap_tokens`` (observations) of its row and the rows before."""
    gap = np.zeros(len(batch), np.int64) if batch.gap_tokens is None else np.asarray(batch.gap_tokens, np.int64)
    total = np.cumsum(gap)
    row_gap = total - total[lin.first_row][lin.row_traj]  # (N,) gaps after the trajectory's first row
    token_row = np.repeat(np.arange(len(batch)), batch.n_tokens.astype(np.int64))
    token_traj = lin.row_traj[token_row]
    return np.arange(n_flat) - lin.start[token_traj] + row_gap[token_row]


def _mean_branch_M(lin: _Lineage, branch_score: np.ndarray, kappa: float, positions: np.ndarray) -> np.ndarray:
    """mean_b M_b[t] over each initial rollout's branches on the flat tokens (M,); 1 without branches (§3.6).

    ``branch_score`` is (J,) BS_b; the max is over all branches of the batch, as in the code.
    ``positions`` (M,) are the tokens' response positions (``_token_positions``).
    """
    n_flat = positions.size
    M_sum, M_count = np.zeros(n_flat), np.zeros(n_flat, dtype=np.int64)
    branches = np.flatnonzero(lin.is_branch)
    bs_max = float(branch_score[branches].max()) if branches.size else 0.0
    for b in branches:
        i = lin.parent[b]
        lo, hi = lin.start[i], lin.start[i] + lin.length[i]
        ratio = branch_score[b] / bs_max if bs_max > 0 else 0.0
        M_sum[lo:hi] += reward_scale_M(int(lin.split[b]), ratio, int(lin.length[i]), kappa, positions[lo:hi])
        M_count[lo:hi] += 1
    return np.where(M_count > 0, M_sum / np.maximum(M_count, 1), 1.0)


def _scaled_returns(batch: StepBatch, lin: _Lineage, M_bar: np.ndarray) -> np.ndarray:
    """R_j with each step reward r_n (on its row's last token) multiplied by M̄ there, (J,) (§3.6).

    Written R_j + Σ_n r_n (M̄_n − 1) so that M̄ = 1 returns ``episode_return`` exactly.
    """
    n_tokens = batch.n_tokens.astype(np.int64)
    has_tokens = n_tokens > 0
    factor = np.ones(n_tokens.size)
    factor[has_tokens] = M_bar[(np.cumsum(n_tokens) - 1)[has_tokens]]
    extra = np.bincount(lin.row_traj, weights=batch.reward * (factor - 1.0), minlength=lin.start.size)
    return batch.episode_return[lin.first_row].astype(np.float64) + extra


def _stats(batch: StepBatch, lin: _Lineage, adv_tokens: np.ndarray, credit_count: np.ndarray) -> dict[str, float]:
    """Plain figures of one batch.

    branches, groups (task groups), branch_credit_fraction (initial-rollout tokens with B_{i,t} ≠ ∅) and
    zero_group_fraction (task groups whose initial-rollout tokens all have A = 0: no signal reaches the loss).
    """
    token_row = np.repeat(np.arange(len(batch)), batch.n_tokens.astype(np.int64))
    init_token = ~lin.is_branch[lin.row_traj[token_row]]
    groups, token_group = np.unique(batch.group_id, return_inverse=True)
    token_group = token_group.reshape(-1)[token_row]
    signal = np.bincount(token_group[init_token], weights=adv_tokens[init_token] != 0, minlength=groups.size)
    return {
        "branches": float(lin.is_branch.sum()),
        "groups": float(groups.size),
        "branch_credit_fraction": float(np.mean(credit_count[init_token] > 0)) if init_token.any() else 0.0,
        "zero_group_fraction": float(np.mean(signal == 0)) if groups.size else 0.0,
    }


@ADVANTAGES.register("appo", APPOParams)
def appo_advantage(batch: StepBatch, params: APPOParams, state: object | None = None) -> AdvantageResult:
    """Dual-group advantage with branch credit mapped onto parent prefixes (§3.5; ``compute_appo_advantage``).

    Trajectories j (rows grouped by ``traj_id``) have R_j = ``episode_return``; groups are (group_id, kind)
    with population std, so a size-1 or all-equal group gives Â = 0 (§3.11). Initial rollout i, flat token
    t over its rows' action tokens in turn order: A_{i,t} = Â_i + mean_{b: parent=i, s_b ≥ t} Â_b.
    Branch rows get A = 0 and keep = False. M (§3.6) reads ``batch.extras["branch_score"]`` (N,) on
    branch rows; without it M = 1. Its discount κ^{s_b − t} counts response positions: the action tokens
    and the ``gap_tokens`` (observations) between turns.

    Returns:
        AdvantageResult: adv_tokens (M,) in row order, adv (N,) per-row token mean (0 for rows without
        tokens), keep (N,), state None, stats from ``_stats``.
    """
    lin = _lineage(batch)
    n_tokens = batch.n_tokens.astype(np.int64)
    n_flat = int(n_tokens.sum())
    M_bar = np.ones(n_flat)  # (M,) mean_b M_b[t]
    if (params.reward_scale_M or params.scale_token_advantages_by_M) and "branch_score" in batch.extras:
        branch_score = np.asarray(batch.extras["branch_score"], np.float64)[lin.first_row]
        M_bar = _mean_branch_M(lin, branch_score, params.reward_scale_discount, _token_positions(batch, lin, n_flat))
    R = _scaled_returns(batch, lin, M_bar) if params.reward_scale_M else batch.episode_return[lin.first_row]
    adv_hat = _group_zscore(np.asarray(R, np.float64), lin.key, params.eps, params.norm_by_std)  # (J,)
    credit_sum, credit_count = _branch_credit(lin, adv_hat, n_flat)
    token_traj = np.repeat(lin.row_traj, n_tokens)  # (M,)
    adv_tokens = adv_hat[token_traj] + np.where(credit_count > 0, credit_sum / np.maximum(credit_count, 1), 0.0)
    if params.scale_token_advantages_by_M:
        adv_tokens = adv_tokens * M_bar
    adv_tokens = np.where(lin.is_branch[token_traj], 0.0, adv_tokens)
    token_row = np.repeat(np.arange(len(batch)), n_tokens)
    adv = np.bincount(token_row, weights=adv_tokens, minlength=len(batch)) / np.maximum(n_tokens, 1)
    keep = ~lin.is_branch[lin.row_traj]
    return AdvantageResult(adv, keep, adv_tokens, stats=_stats(batch, lin, adv_tokens, credit_count))
