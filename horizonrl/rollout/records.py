"""What a rollout produces and the store writes: one ``EpisodeRecord`` per episode with its ``TurnRecord``s.

Plain data, apart from both the rollout loop (which fills them) and the store (which turns them into
Parquet tables), so that the store does not depend on how rollouts are played.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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

    @classmethod
    def of_step(
        cls,
        turn: int,
        observation: str,
        before: dict[str, Any],
        action: str,
        prompt_ids: list[int],
        gen: Generation,
        reward: float,
        done: bool,
        after: dict[str, Any],
        format_valid: bool = True,
        gen_s: float = 0.0,
        env_s: float = 0.0,
    ) -> TurnRecord:
        """Turn ``turn``: ``action`` (``gen``, sampled from ``prompt_ids``, or scripted) played on ``observation``,
        whose info was ``before``, and the environment's answer, ``reward``, ``done`` and info ``after``. The
        admissible commands and the progress key are the state's the action was taken in; outcome, validity,
        score and abstract action the answer's."""
        commands = before["admissible_commands"]
        return cls(
            turn=turn,
            observation=observation,
            action=action,
            prompt_ids=prompt_ids,
            gen=gen,
            reward=float(reward),
            done=bool(done),
            won=bool(after.get("won", False)),
            valid=bool(after.get("valid", action in commands)),
            format_valid=format_valid,
            score=float(after.get("score", 0.0)),
            progress_key=str(before.get("progress_key", "")),
            abstract_action=str(after.get("abstract_action", "")),
            n_admissible=len(commands),
            gen_s=gen_s,
            env_s=env_s,
        )


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
