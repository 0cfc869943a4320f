"""Demonstrations for behaviour cloning: a suite's walkthroughs played as episodes in the trajectory schema.

A demonstration is an ``EpisodeRecord`` whose actions come from the environment's oracle walkthrough
instead of the policy, built with the same prompt functions as a rollout (``prompting.full_delta`` /
``window_prompt``), so ``sequences.train_rows`` rebuilds exactly the sequences the policy will see when
it plays. Its episodes row has ``kind = "demonstration"`` and its log-probs are 0 (nothing was sampled).

In admissible mode each action token carries the set of tokens the command trie allows at that point
(as the engine records it), and tokens with a single continuation are not policy tokens: the learner
scores the demonstration under the same renormalised distribution it samples from.
"""

from __future__ import annotations

import random
from typing import Literal

from horizonrl.engines.base import Generation, TokenTrie
from horizonrl.envs.base import EnvSuite, Task
from horizonrl.rollout.prompting import ChatFormat, full_delta, window_prompt
from horizonrl.rollout.records import EpisodeRecord, TurnRecord
from horizonrl.seeding import derive_seed

DEMONSTRATION = "demonstration"  # the episodes table's ``kind`` of a demonstration


def play_walkthroughs(
    suite: EnvSuite,
    tasks: list[Task],
    fmt: ChatFormat,
    *,
    action_mode: str,
    context: str,
    history_turns: int,
    max_turns: int,
    perturbed_share: float = 0.0,
    seed: int = 0,
    expert: Literal["walkthrough", "search"] = "walkthrough",
) -> list[EpisodeRecord]:
    """One demonstration per task (rollout id = group id = its index), played by ``expert``: the suite's
    ``walkthrough``, or the household's ``search_walkthrough``. A perturbed demonstration (the first
    ``round(perturbed_share * len(tasks))`` of a seeded shuffle) plays, at one seeded turn, a random other
    admissible command instead of the walkthrough's, then goes on with the walkthrough."""
    rng = random.Random(derive_seed(seed, "perturb"))
    order = list(range(len(tasks)))
    rng.shuffle(order)
    perturbed = set(order[: round(perturbed_share * len(tasks))])
    env = suite.make()
    try:
        return [
            _play_one(
                env,
                i,
                task,
                fmt,
                action_mode,
                context,
                history_turns,
                max_turns,
                random.Random(derive_seed(seed, "perturb", i)) if i in perturbed else None,
                expert,
            )
            for i, task in enumerate(tasks)
        ]
    finally:
        env.close()


def _play_one(
    env,
    index: int,
    task: Task,
    fmt: ChatFormat,
    action_mode: str,
    context: str,
    history_turns: int,
    max_turns: int,
    rng: random.Random | None,
    expert: str,
) -> EpisodeRecord:
    obs, info = env.reset(task)
    plan = (env.search_walkthrough() if expert == "search" else env.walkthrough())[:max_turns]
    swap = rng.randrange(len(plan)) if rng is not None and plan else -1
    record = EpisodeRecord(index, index, task, context, 0, kind=DEMONSTRATION)
    goal_ids = fmt.system(info.get("goal", ""))
    history: list[tuple[list[int], list[int]]] = []  # (observation ids, action ids) per turn
    for turn, action in enumerate(plan):
        commands = info["admissible_commands"]
        if turn == swap:
            others = [c for c in commands if c != action]
            action = rng.choice(others) if others else action
        obs_ids = fmt.user(obs, commands)
        if context == "full":
            delta = full_delta(fmt, goal_ids, obs_ids, history[-1][1] if history else None)
        else:
            delta = window_prompt(fmt, goal_ids, history, obs_ids, history_turns)
        gen = _scripted(fmt, action, commands if action_mode == "admissible" else None)
        history.append((obs_ids, gen.token_ids))
        next_obs, reward, done, next_info = env.step(action)
        record.turns.append(TurnRecord.of_step(turn, obs, info, action, delta, gen, reward, done, next_info))
        obs, info = next_obs, next_info
        if done:
            record.status = "won" if next_info.get("won") else "done"
            return record
    record.status = "truncated"
    return record


def _scripted(fmt: ChatFormat, action: str, commands: list[str] | None) -> Generation:
    """The action's token ids as a ``Generation``: allowed sets walked down the command trie (admissible
    mode, command admissible), else the full vocabulary; log-probs and entropies 0."""
    ids = fmt.command(action)
    allowed: list[list[int]] = [[] for _ in ids]
    if commands is not None and action in commands:
        node = TokenTrie([fmt.command(c) for c in commands]).root
        for k, t in enumerate(ids):
            allowed[k] = sorted(node)
            node = node[t]
    mask = [len(a) != 1 for a in allowed]
    return Generation(ids, [0.0] * len(ids), [0.0] * len(ids), mask, allowed, True)
