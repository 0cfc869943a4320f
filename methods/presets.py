"""Method presets: what each method is (an advantage estimator, a policy loss and the loss settings its
paper or released code uses, docs/algorithms.md §1.7, §2.10, §3.8, §4) and what the pipeline must do for it
(play APPO's branches, divide LOOP's loss by the fixed minibatch size). LOOP has no KL term; GRPO and APPO a
low-variance KL loss of 0.001 to the initial policy, GiGPO and BLPO 0.01 (BLPO's actor settings are an
assumption, docs/algorithms.md §6.1), REINFORCE++-baseline an MSE KL loss of 0.001 (verl's example).
The config (``horizonrl.config``) picks a preset by name and checks overrides against it."""

from __future__ import annotations

import dataclasses
from typing import Any

from methods.registry import ADVANTAGES


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodPreset:
    """What a method is and what the pipeline does for it: tasks read these, never the method's name."""

    title: str  # the method's name in prose (README, pyproject's description; tests/test_method_lists.py)
    advantage: str  # name in methods.ADVANTAGES
    loss: str  # name in methods.LOSSES
    loss_params: dict[str, Any]  # the method's loss settings (kl_coef > 0 loads the reference policy)
    min_group_size: int  # rollouts per task the estimator needs
    epochs: int
    fixed_row_divisor: bool = False  # LOOP divides by the fixed minibatch size (docs/algorithms.md §1.5)
    branches: bool = False  # APPO: branch rollouts planned over the initial ones (params: BranchingParams)


_VERL_CLIP = {
    "clip_mode": "asymmetric",
    "eps_low": 0.2,
    "eps_high": 0.2,
    "dual_clip_c": 3.0,
}  # verl's PPO clip (docs/algorithms.md §4)

METHODS: dict[str, MethodPreset] = {
    "loop": MethodPreset(
        title="LOOP",
        advantage="loo",
        loss="ppo_clip",
        loss_params={"clip_mode": "loop", "eps": 0.1, "aggregation": "seq-mean-token-mean"},
        min_group_size=2,
        epochs=2,
        fixed_row_divisor=True,
    ),
    "rloo": MethodPreset(
        title="RLOO",
        advantage="rloo",
        loss="ppo_clip",
        loss_params={**_VERL_CLIP, "aggregation": "token-mean"},
        min_group_size=2,
        epochs=1,
    ),
    "grpo": MethodPreset(
        title="GRPO",
        advantage="grpo",
        loss="ppo_clip",
        loss_params={**_VERL_CLIP, "aggregation": "token-mean", "kl_coef": 0.001},
        min_group_size=2,
        epochs=1,
    ),
    "drgrpo": MethodPreset(
        title="Dr.GRPO",
        advantage="drgrpo",
        loss="ppo_clip",
        loss_params={**_VERL_CLIP, "aggregation": "seq-mean-token-sum-norm"},
        min_group_size=2,
        epochs=1,
    ),
    "reinforce_pp_baseline": MethodPreset(
        title="REINFORCE++-baseline",
        advantage="reinforce_pp_baseline",
        loss="ppo_clip",
        loss_params={**_VERL_CLIP, "aggregation": "token-mean", "kl_coef": 0.001, "kl_kind": "mse"},
        min_group_size=2,
        epochs=1,
    ),
    "gigpo": MethodPreset(
        title="GiGPO",
        advantage="gigpo",
        loss="ppo_clip",
        loss_params={**_VERL_CLIP, "aggregation": "token-mean", "kl_coef": 0.01},
        min_group_size=2,
        epochs=1,
    ),
    "blpo": MethodPreset(
        title="BLPO",
        advantage="blpo",
        loss="ppo_clip",
        loss_params={**_VERL_CLIP, "aggregation": "token-mean", "kl_coef": 0.01},
        min_group_size=1,
        epochs=1,
    ),
    "appo": MethodPreset(
        title="APPO",
        advantage="appo",
        loss="appo_future_kl",
        loss_params={"kl_coef": 0.001},
        min_group_size=2,
        epochs=1,
        branches=True,
    ),
}


def estimator_of(name: str) -> str:
    """The advantage estimator a method stands for, or ``name`` itself if it is an estimator's name.

    Raises ``ValueError`` naming both lists when it is neither."""
    if name in METHODS:
        return METHODS[name].advantage
    if name in ADVANTAGES:
        return name
    raise ValueError(
        f"{name!r} is neither a method ({', '.join(sorted(METHODS))}) nor an estimator "
        f"({', '.join(ADVANTAGES.names())})"
    )
