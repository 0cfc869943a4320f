"""What a rollout produces and the store writes: one ``EpisodeRecord`` per episode with its ``TurnRecord``s.

Plain data, apart from both the rollout loop (which fills them) and the store (which turns them into
Parquet tables), so that the store does not depend on how rollouts are played.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from horizonrl.engines.base import Generation
from horizonrl.envs.base import Task


@dataclass
class TurnRecord:
    turn: int
    observation: str  # the observation the action answers (anchor_obs)
    action: str
    prompt_ids: list[int]  # window: the whole prompt; full: the ids added since the previous action
    gen: Generation
    reward: float
    done: bool
    won: bool
    valid: bool
    format_valid: bool
    score: float
    progress_key: str  # task-progress key of the state the action was taken in
    abstract_action: str
    n_admissible: int
    gen_s: float
    env_s: float


ENGINE_FAULT = "engine fault: "
"""How an episode's ``error`` starts when the sampler failed it (a dead vLLM server, a non-finite log-prob):
nothing about the policy or the task, so an evaluation with such an episode measures nothing (``tasks.evaluate``)."""


@dataclass
class EpisodeRecord:
    rollout_id: int
    group_id: int
    task: Task
    context: str  # "window" | "full"
    sample_seed: int
    kind: str = "initial"  # "initial" | "branch" | "demonstration" (horizonrl.training.demonstrations)
    parent_rollout: int = -1
    branch_token: int = -1
    turns: list[TurnRecord] = field(default_factory=list)
    status: str = "running"  # "won" | "done" (ended without winning) | "truncated" (horizon) | "error"
    error: str = ""  # why it ended as an error; ``ENGINE_FAULT`` first when the sampler, not the environment, failed
    branch_score: float = 0.0  # APPO branching score BS at the split (branches only)

    @property
    def episode_return(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def won(self) -> bool:
        return bool(self.turns and self.turns[-1].won)
