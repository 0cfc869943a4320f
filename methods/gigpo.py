"""GiGPO: group-in-group policy optimization (arXiv 2505.10978; docs/algorithms.md §4.3, §0.4, §7.1, §7.4).

A_n = A^E_n + w * A^S_n, one scalar per step row (the caller broadcasts it over the row's tokens):

* A^E (episode term): the row's score normalised inside its task group (uid), with the statistics
  taken over all step rows of the group (``cross_steps = True``, verl-agent's default);
* A^S (step term): the discounted step return G_n normalised inside its anchor group, the rows of
  one uid with identical ``anchor_obs``.

Invalid-action penalty (verl-agent ``apply_invalid_action_penalty``): ``invalid_penalty`` p is
subtracted from the step row's score and from its step reward when ``valid`` is False, so
score_n = R_n - p (1 - valid_n) and G is built from r'_n = r_n - p (1 - valid_n).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from methods.registry import ADVANTAGES
from methods.stepwise import (
    MODES,
    codes_within_groups,
    discounted_returns,
    first_rows,
    group_standardize,
    hashed_codes,
    pair_codes,
    penalized_score_and_reward,
    require_finite,
    trajectory_starts,
)
from methods.types import AdvantageResult, StepBatch


@dataclass(frozen=True)
class GiGPOParams:
    """GiGPO settings (docs/algorithms.md §4.3).

    ``mode`` defaults to ``mean_std_norm``, the verl-agent fork's yaml; recent verl-agent run scripts
    use ``mean_norm``. 6.7 asks every experiment to name its choice, so configs should set it.
    """

    gamma: float = 0.95  # discount of the step returns G_n
    mode: str = "mean_std_norm"  # "mean_std_norm": (x - mu)/(sigma + eps); "mean_norm": x - mu
    step_advantage_w: float = 1.0  # w, weight of the step term
    eps: float = 1e-6  # added to the unbiased std
    invalid_penalty: float = 0.1  # p, subtracted from score and step reward of invalid actions
    cross_steps: bool = True  # episode statistics over all step rows (True) or one score per trajectory

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"GiGPOParams.mode {self.mode!r} not in {MODES}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"GiGPOParams.gamma must lie in [0, 1], got {self.gamma}")
        if self.eps <= 0.0:
            raise ValueError(f"GiGPOParams.eps must be positive, got {self.eps}")


def episode_advantage(
    score: np.ndarray, uid: np.ndarray, n_uid: int, starts: np.ndarray, params: GiGPOParams
) -> np.ndarray:
    """A^E_n = (score_n - mu_uid) / (sigma_uid + eps), or score_n - mu_uid (4.3, 0.4).

    mu and the unbiased sigma run over all step rows of the uid (``cross_steps``), or over one score
    per trajectory (the score of its first row) when ``cross_steps`` is False; each row then
    normalises its own score with those statistics, as verl-agent does (7.4). A group with one
    member has mu = 0 and sigma = 1, so A^E = score / (1 + eps) (7.1).
    """
    if params.cross_steps:  # uid is numbered in first-appearance order (``hashed_codes``)
        return group_standardize(score, uid, n_uid, params.mode, params.eps, "raw", first=first_rows(uid))
    return group_standardize(
        score[starts], uid[starts], n_uid, params.mode, params.eps, "raw", x_apply=score, codes_apply=uid
    )


@ADVANTAGES.register("gigpo", GiGPOParams)
def gigpo_advantage(batch: StepBatch, params: GiGPOParams, state: object | None = None) -> AdvantageResult:
    """A_n = A^E_n + w * A^S_n with A^S_n = (G_n - mu_anchor) / (sigma_anchor + eps) (4.3).

    Anchor groups are (uid, anchor_obs); a size-1 anchor group gives A^S = 0. GiGPO keeps no state.

    Args:
        batch: step rows; needs ``anchor_obs`` and ``valid`` besides the required columns.
        params: ``GiGPOParams``.
        state: ignored (stateless estimator).

    Returns:
        ``AdvantageResult`` with ``adv`` (N,) and ``keep`` all True.
    """
    batch.require("anchor_obs", "valid")
    require_finite(batch, "reward", "episode_return")
    starts = trajectory_starts(batch)
    score, reward = penalized_score_and_reward(batch, params.invalid_penalty)
    returns = discounted_returns(reward, starts, params.gamma)  # (N,) G_n
    uid, n_uid = hashed_codes(batch.group_id)  # numbered by first appearance: no sort
    obs, n_obs = codes_within_groups(batch.anchor_obs, uid)  # told apart inside each uid only
    anchor, n_anchor = pair_codes(uid, obs, n_obs)  # obs's own codes when each names one uid
    adv_episode = episode_advantage(score, uid, n_uid, starts, params)
    adv_step = group_standardize(returns, anchor, n_anchor, params.mode, params.eps, "zero")
    adv = adv_episode + params.step_advantage_w * adv_step
    return AdvantageResult(
        adv=adv,
        keep=np.ones(len(batch), dtype=bool),
        stats=_stats(anchor, n_anchor, adv_episode, adv_step),
    )


def _stats(anchor: np.ndarray, n_anchor: int, adv_episode: np.ndarray, adv_step: np.ndarray) -> dict:
    """Anchor-group sizes and mean absolute terms (plain figures; the task names them)."""
    size = np.bincount(anchor, minlength=n_anchor)  # (G,)
    n_rows = max(len(anchor), 1)
    return {
        "anchor_groups": float(n_anchor),
        "anchor_group_size_mean": float(size.mean()) if n_anchor else 0.0,
        "anchor_grouped_fraction": float(size[size >= 2].sum() / n_rows),
        "mean_abs_adv_step": float(np.abs(adv_step).sum() / n_rows),
        "mean_abs_adv_episode": float(np.abs(adv_episode).sum() / n_rows),
    }
