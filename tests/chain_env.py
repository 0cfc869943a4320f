"""A chain of turns whose true per-turn advantage is known in closed form, and an oracle policy that plays it
with fixed probabilities (test doubles of an environment and a model, for the credit audit's proof,
tests/test_audit.py).

Every turn offers ``left`` and ``right``; the policy takes ``left`` with probability P_LEFT at every turn.
The action at turn DECISIVE alone decides the episode: ``left`` there wins (reward 1 at the last turn,
HORIZON), ``right`` loses; every other action is neutral. The observation says the turn and, after the
decisive turn, the lever's position, so it is the state (Markov). Under that policy:

    A(s_t, a_t) = Q(s_t, a_t) - V(s_t) = 1{a_t = left} - P_LEFT   at t = DECISIVE,   0 at every other turn.
"""

from __future__ import annotations

import math

import numpy as np

from horizonrl.engines.base import Generation, SampleRequest
from horizonrl.envs.base import Task

HORIZON = 4
DECISIVE = 1
P_LEFT = 0.7
COMMANDS = ["left", "right"]
GOAL = "pull the lever the right way"


def true_advantage(turn: int, action: str) -> float:
    """The closed form of the module docstring."""
    return (float(action == "left") - P_LEFT) if turn == DECISIVE else 0.0


class ChainEnv:
    """One episode of the chain (deterministic: a replay reaches the same states)."""

    def reset(self, task: Task) -> tuple[str, dict]:
        self.t, self.lever = 0, ""
        return self._obs(), self._info(won=False)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.t == DECISIVE:
            self.lever = "up" if action == "left" else "down"
        self.t += 1
        done = self.t == HORIZON
        won = done and self.lever == "up"
        return self._obs(), float(won), done, {**self._info(won), "valid": action in COMMANDS}

    def _obs(self) -> str:
        return f"room {self.t}" + (f" lever {self.lever}" if self.lever else "")

    def _info(self, won: bool) -> dict:
        key = self._obs()
        return {"won": won, "admissible_commands": list(COMMANDS), "score": float(won), "progress_key": key}

    def goal(self) -> str:
        return GOAL

    def abstract_action(self, action: str) -> str:
        return action

    def walkthrough(self) -> list[str]:
        return ["left"] * HORIZON

    def close(self) -> None:
        pass


class ChainSuite:
    name = "chain"

    def tasks(self, split: str, tier: str, n: int, offset: int = 0) -> list[Task]:
        return [Task("chain", split, tier, offset + i, offset + i, "chain") for i in range(n)]

    def make(self) -> ChainEnv:
        return ChainEnv()

    def corpus(self, n_tasks: int = 200) -> list[str]:
        return [GOAL, *COMMANDS, "room lever up down", *map(str, range(HORIZON + 1))]

    def max_turns(self, tier: str) -> int:
        return HORIZON


class OracleEngine:
    """Samples a whole admissible command at once with P_LEFT / 1 - P_LEFT, each prompt of a call from its own
    generator seeded by (the call's seed, its row): a fixed policy, no model."""

    def session(self) -> OracleEngine:
        return self

    def extend(self, slots: list[int], request: SampleRequest) -> list[Generation]:
        return self.generate(request)

    def generate(self, request: SampleRequest) -> list[Generation]:
        out = []
        for row, trie in enumerate(request.tries):
            by_text = {text: list(ids) for ids, text in trie.texts.items()}
            p = {"left": P_LEFT, "right": 1 - P_LEFT}
            choice = "left" if np.random.default_rng([request.seed, row]).random() < P_LEFT else "right"
            ids = by_text[choice]
            entropy = -sum(q * math.log(q) for q in p.values())
            rest = len(ids) - 1
            out.append(Generation(ids, [math.log(p[choice])] + [0.0] * rest, [entropy] + [0.0] * rest,
                                  [True] + [False] * rest, [[]] * len(ids)))  # fmt: skip
        return out
