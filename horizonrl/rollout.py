"""The multi-turn rollout loop: every active episode of a batch advances one turn per engine call.

``collect`` plays K rollouts of each task in lockstep: build each episode's prompt, one batched
``generate``, step every environment, repeat until all are done or the horizon is reached. It returns
plain records (``EpisodeRecord``/``TurnRecord``) that the store writes as Parquet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from horizonrl.engines.base import Engine, Generation, Session, TokenTrie
from horizonrl.envs.base import Env, EnvSuite, Task
from horizonrl.prompting import ChatFormat, full_delta, window_prompt
from horizonrl.seeding import derive_seed


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


@dataclass
class EpisodeRecord:
    rollout_id: int
    group_id: int
    task: Task
    context: str  # "window" | "full"
    sample_seed: int
    kind: str = "initial"  # "initial" | "branch"
    parent_rollout: int = -1
    branch_token: int = -1
    turns: list[TurnRecord] = field(default_factory=list)
    status: str = "running"  # "won" | "truncated" | "error"
    error: str = ""

    @property
    def episode_return(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def won(self) -> bool:
        return bool(self.turns and self.turns[-1].won)


@dataclass
class _Live:
    """Per-episode rollout state that is not stored."""

    record: EpisodeRecord
    env: Env
    obs: str
    info: dict
    goal_ids: list[int]
    history: list[tuple[list[int], list[int]]] = field(default_factory=list)
    done: bool = False


def collect(
    suite: EnvSuite,
    tasks: list[Task],
    group_size: int,
    engine: Engine,
    fmt: ChatFormat,
    *,
    action_mode: str,
    context: str,
    history_turns: int,
    max_turns: int,
    max_action_tokens: int,
    temperature: float,
    seed: int,
    greedy: bool = False,
    first_rollout_id: int = 0,
) -> list[EpisodeRecord]:
    """Play ``group_size`` rollouts of every task; rollout r of task g has group_id g."""
    live: list[_Live] = []
    for g, task in enumerate(tasks):
        for k in range(group_size):
            rid = first_rollout_id + g * group_size + k
            env = suite.make()
            obs, info = env.reset(task)
            rec = EpisodeRecord(rid, g, task, context, derive_seed(seed, "sample", rid))
            live.append(_Live(rec, env, obs, info, fmt.system(env.goal())))
    session = engine.session() if context == "full" else None  # one KV cache across turns
    for turn in range(max_turns):
        batch = [ep for ep in live if not ep.done]
        if not batch:
            break
        _play_turn(batch, turn, engine, session, fmt, action_mode, history_turns, max_action_tokens, temperature, greedy, derive_seed(seed, "turn", turn))
    for ep in live:
        if not ep.done:
            ep.record.status = "truncated"
        ep.env.close()
    return [ep.record for ep in live]


def _play_turn(batch: list[_Live], turn: int, engine: Engine, session: Session | None, fmt: ChatFormat, action_mode: str, history_turns: int, max_action_tokens: int, temperature: float, greedy: bool, seed: int) -> None:
    """One engine call for every active episode. ``deltas`` are what each turn row stores as prompt ids:
    the whole prompt in window context, only the new ids in full context (the session holds the rest)."""
    deltas, tries = [], []
    for ep in batch:
        obs_ids = fmt.user(ep.obs)
        if session is None:
            deltas.append(window_prompt(fmt, ep.goal_ids, ep.history, obs_ids, history_turns))
        else:
            deltas.append(full_delta(fmt, ep.goal_ids, obs_ids, ep.history[-1][1] if ep.history else None))
        ep.history.append((obs_ids, []))
        tries.append(_trie(fmt, ep.info["admissible_commands"]) if action_mode == "admissible" else None)
    t0 = time.perf_counter()
    if session is None:
        gens = engine.generate(deltas, tries, max_action_tokens, temperature, greedy, seed)
    else:
        gens = session.extend([ep.record.rollout_id for ep in batch], deltas, tries, max_action_tokens, temperature, greedy, seed)
    gen_s = (time.perf_counter() - t0) / len(batch)
    for ep, delta, gen, trie in zip(batch, deltas, gens, tries):
        _step_env(ep, turn, delta, gen, fmt, gen_s, trie)


def _step_env(ep: _Live, turn: int, delta: list[int], gen: Generation, fmt: ChatFormat, gen_s: float, trie: TokenTrie | None) -> None:
    """Admissible mode takes the command's own text from the trie; free mode parses decoded text."""
    if trie is not None and tuple(gen.token_ids) in trie.texts:
        action = trie.texts[tuple(gen.token_ids)]
    else:
        ids = gen.token_ids[:-1] if gen.finished and gen.token_ids and gen.token_ids[-1] == fmt.end_id else gen.token_ids
        action = fmt.tokenizer.decode(ids, skip_special_tokens=True).strip()
    format_valid = gen.finished and bool(action)
    admissible = ep.info["admissible_commands"]
    progress_key = str(ep.info.get("progress_key", ""))
    abstract = ep.env.abstract_action(action)
    t0 = time.perf_counter()
    obs, reward, done, info = ep.env.step(action)
    env_s = time.perf_counter() - t0
    ep.history[-1] = (ep.history[-1][0], gen.token_ids)
    ep.record.turns.append(
        TurnRecord(
            turn, ep.obs, action, delta, gen, float(reward), bool(done), bool(info.get("won", False)),
            bool(info.get("valid", action in admissible)), format_valid, float(info.get("score", 0.0)),
            progress_key, abstract, len(admissible), gen_s, env_s,
        )
    )
    ep.obs, ep.info = obs, info
    if done:
        ep.done = True
        ep.record.status = "won" if info.get("won") else "done"


def _trie(fmt: ChatFormat, commands: list[str]) -> TokenTrie:
    return TokenTrie([fmt.command(c) for c in commands], commands)
