"""The environment protocol every text environment implements, and the task record.

An environment is a multi-turn text game: ``reset(task)`` gives the first observation, ``step(action)``
plays one command. ``info`` always carries ``won`` (bool), ``admissible_commands`` (list[str]),
``valid`` (the action was admissible), ``score`` (progress in [0, 1]) and, for BLPO,
``progress_key`` (task-progress state computed only from what the agent has seen and done) .
``abstract_action(action)`` labels a command relative to the goal, *before* it is played.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Task:
    """One playable task: which generator, which split and tier, and the seed that builds it."""

    env: str  # environment suite name, e.g. "household"
    split: str  # "train" | "test" (| "dev" where a suite has one)
    tier: str  # difficulty tier, e.g. "easy"
    index: int  # position in the split's task list
    seed: int  # seed that generates the task deterministically
    family: str = ""  # task family, e.g. "pick_and_place"

    @property
    def task_id(self) -> str:
        return f"{self.env}/{self.tier}/{self.split}/{self.index}"


@runtime_checkable
class Env(Protocol):
    """A single running episode. Not thread-safe; one per worker."""

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start ``task``; return (observation, info). The observation includes the goal."""
        ...

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Play ``action``; return (observation, reward, done, info)."""
        ...

    def goal(self) -> str:
        """The task's instruction, e.g. 'put a clean apple in fridge'."""
        ...

    def abstract_action(self, action: str) -> str:
        """Goal-relative function label of ``action`` in the current state (docs/algorithms.md §2.4)."""
        ...

    def walkthrough(self) -> list[str]:
        """An oracle action list that solves the task from reset (tests and warm-start only)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class EnvSuite(Protocol):
    """A family of tasks with fixed, disjoint splits, and a factory for episodes."""

    name: str

    def tasks(self, split: str, tier: str, n: int, offset: int = 0) -> list[Task]:
        """The first ``n`` tasks of ``split`` (starting at ``offset``); fixed by the suite's seed."""
        ...

    def make(self) -> Env:
        """A fresh environment instance that can reset to any of this suite's tasks."""
        ...

    def corpus(self, n_tasks: int = 200) -> list[str]:
        """Representative text (goals, observations, commands) for training a tokenizer."""
        ...

    def max_turns(self, tier: str) -> int:
        """Horizon of the tier."""
        ...


RANDOM_TURNS = 20
"""Turns of random play an episode of a benchmark suite's corpus takes (``played_lines``)."""


def played_lines(env: Env, task: Task, oracle: bool, random_turns: int = RANDOM_TURNS) -> list[str]:
    """The observations and admissible commands of one episode of ``task`` (a suite's corpus, which a
    word tokenizer is trained on): its walkthrough, or uniform random play (seeded by the task) for up to
    ``random_turns`` turns."""
    observation, info = env.reset(task)
    lines = [observation, *info["admissible_commands"]]
    rng = random.Random(task.seed)
    plan: list[str | None] = list(env.walkthrough()) if oracle else [None] * random_turns
    for planned in plan:
        observation, _, done, info = env.step(planned or rng.choice(info["admissible_commands"]))
        lines += [observation, *info["admissible_commands"]]
        if done:
            break
    return lines
