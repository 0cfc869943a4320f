"""Columnar inputs and outputs shared by every advantage estimator.

Notation (used in every shape comment under ``methods/``):
    N  step rows (one per decision/turn; a trajectory is its rows in turn order)
    M  action tokens, all rows concatenated in row order (row n owns ``n_tokens[n]`` of them)
    K  rollouts in one task group, G groups

Trajectory-level methods (LOOP, GRPO, RLOO) read ``episode_return`` and give every row of a
trajectory the same value; step-level methods (GiGPO, BLPO) read the per-step columns; APPO reads the
branch lineage and returns per-token advantages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepBatch:
    """One row per decision step, rows of a trajectory contiguous and in turn order.

    Required columns are the first six; the rest default to ``None`` and an estimator that needs one
    raises ``ValueError`` naming it.
    """

    group_id: np.ndarray  # (N,) int64: task group (uid); the K rollouts of one task share it
    traj_id: np.ndarray  # (N,) int64: trajectory id, unique in the batch
    turn: np.ndarray  # (N,) int64: 0-based index of the step inside its trajectory
    reward: np.ndarray  # (N,) float64: environment reward of this step (r_n)
    episode_return: np.ndarray  # (N,) float64: trajectory return R, repeated on each of its rows
    n_tokens: np.ndarray  # (N,) int64: action (policy) tokens of the row
    update_index: int = 0  # global policy-update counter u (BLPO memory decay)
    anchor_obs: np.ndarray | None = None  # (N,) object[str]: observation before the action
    action: np.ndarray | None = None  # (N,) object[str]: action text as sent to the environment
    valid: np.ndarray | None = None  # (N,) bool: action admissible and well formatted
    format_valid: np.ndarray | None = None  # (N,) bool: action parsed at all
    progress_key: np.ndarray | None = None  # (N,) object[str]: task-progress (role) key before the action
    abstract_action: np.ndarray | None = None  # (N,) object[str]: goal-relative action label
    context_id: np.ndarray | None = None  # (N,) object[str]: concrete context id (task family + obs)
    shareable: np.ndarray | None = None  # (N,) bool: row may read/write cross-context memory
    kind: np.ndarray | None = None  # (N,) int8: 0 initial rollout, 1 branch (APPO)
    parent_traj: np.ndarray | None = None  # (N,) int64: source trajectory of a branch, -1 otherwise
    branch_token: np.ndarray | None = None  # (N,) int64: split index s_b in the parent's action tokens, -1 otherwise
    # (N,) int64: response positions between the previous row's action and this one's (observation tokens; 0 on a
    # first row); None: 0
    gap_tokens: np.ndarray | None = None
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # (N,) arrays an estimator may need

    def require(self, *names: str) -> None:
        """Raise ``ValueError`` naming the first optional column that is missing."""
        for name in names:
            if getattr(self, name) is None:
                raise ValueError(f"StepBatch.{name} is required by this estimator but is None")

    def __len__(self) -> int:
        return int(self.group_id.shape[0])


@dataclass
class AdvantageResult:
    """What an estimator returns.

    ``adv`` is broadcast over a row's action tokens unless ``adv_tokens`` is given (APPO), in which case
    ``adv_tokens`` holds one value per action token (M,) in row order and ``adv`` is the per-row mean.
    ``keep`` marks rows that enter the loss; filtered rows are excluded from every loss denominator.
    ``state`` is the estimator's state after this batch (BLPO memory), ``None`` for stateless ones.
    ``stats`` are plain figures (no metric-name prefixes); the calling task names them.
    """

    adv: np.ndarray  # (N,) float64
    keep: np.ndarray  # (N,) bool
    adv_tokens: np.ndarray | None = None  # (M,) float64
    state: Any = None
    stats: dict[str, float] = field(default_factory=dict)
