"""The multi-turn rollout loop: every active episode of a batch advances one turn per engine call.

``collect`` plays K rollouts of each task in lockstep: build each episode's prompt, one batched
``generate``, step every environment (one ``step_many`` on an ``EpisodeBatch``: in this process or in
worker processes), repeat until all are done or the horizon is reached, as ``SamplingSettings`` say. It
returns plain records (``horizonrl.rollout.records``) that the store writes as Parquet. An environment that fails ends
its
episode with status ``error`` and the reason; the rest of the batch goes on.

With ``overlap`` the episodes form two fixed halves, A (the first ceil(n/2)) and B, played as a
pipeline, so one half generates while the other half's environments step::

    generate A | step_start A | generate B | step_finish A | step_start B | generate A | step_finish B | ...

Each half counts its own turns and samples turn ``step`` with ``derive_seed(seed, "turn", step, half)``.
The engine batches differ from lockstep (so do the samples), but they are fixed by the config, never by
which ``EpisodeBatch`` stepped the environments or how fast.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from horizonrl.config import EnvConfig, RolloutConfig, TrainConfig
from horizonrl.engines.base import Engine, Generation, SampleRequest, Session, TokenTrie
from horizonrl.envs.base import EnvSuite, Task
from horizonrl.envs.batch import EpisodeBatch, StepResult, as_batch, error_info
from horizonrl.rollout.prompting import ChatFormat, full_delta, window_prompt
from horizonrl.rollout.records import ENGINE_FAULT, EpisodeRecord, TurnRecord
from horizonrl.seeding import derive_seed


def turn_horizon(env: EnvConfig, suite: EnvSuite) -> int:
    """The turn horizon episodes are cut at: ``env.max_turns``, else the suite's for the tier."""
    return env.max_turns or suite.max_turns(env.tier)


@dataclass
class LiveEpisode:
    """Per-episode rollout state that is not stored (the record is)."""

    record: EpisodeRecord
    slot: int  # the episode's slot in the EpisodeBatch
    obs: str
    info: dict
    goal_ids: list[int]
    history: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (obs ids, action ids) per turn
    done: bool = False
    engine_prefix: list[int] = field(default_factory=list)  # branch, full context: copied turns, fed once
    pending: Generation | None = None  # branch: the parent's action tokens up to the split, continued next


@dataclass(frozen=True)
class SamplingSettings:
    """How a batch of rollouts is played and sampled: the ``rollout.*`` settings, the horizon and a seed."""

    action_mode: str  # "admissible" (trie-constrained decoding) | "free" (parse the text)
    context: str  # "window" | "full"
    history_turns: int  # window context: past turns in the prompt
    max_turns: int
    max_action_tokens: int
    temperature: float
    seed: int
    overlap: bool = False  # the two-half pipeline (module docstring)
    greedy: bool = False

    @classmethod
    def from_config(cls, cfg: TrainConfig, suite: EnvSuite, seed: int, greedy: bool = False) -> SamplingSettings:
        """The run's settings; the horizon is ``env.max_turns`` or the tier's."""
        r = cfg.rollout
        return cls(
            r.action_mode,
            r.context,
            r.history_turns,
            turn_horizon(cfg.env, suite),
            r.max_action_tokens,
            r.temperature,
            seed,
            r.overlap,
            greedy,
        )


@dataclass(frozen=True)
class _Sampling:
    """What every engine call of one rollout batch shares."""

    engine: Engine
    fmt: ChatFormat
    settings: SamplingSettings


@dataclass
class _Turn:
    """One engine call's actions, from generation until their environment results are recorded."""

    batch: list[LiveEpisode]
    deltas: list[list[int]]  # per episode: the prompt ids its turn row stores
    actions: list[tuple[Generation, str, bool]]  # (generation, command, format_valid)
    broken: dict[int, str]  # slot -> why its generation cannot be played ("" if it can)
    gen_s: float  # per episode
    env_s: float = 0.0  # time the loop spent in the environment calls of this turn, all episodes
    format_penalty: float = 0.0  # subtracted from the step reward of a format error

    def sent(self) -> dict[int, str]:
        """The actions to play: every episode's but those whose generation is broken."""
        return {ep.slot: action for ep, (_, action, _) in zip(self.batch, self.actions) if not self.broken[ep.slot]}


def collect(
    envs: EpisodeBatch | EnvSuite,
    tasks: list[Task],
    group_size: int,
    engine: Engine,
    fmt: ChatFormat,
    settings: SamplingSettings,
    *,
    first_rollout_id: int = 0,
    first_group_id: int = 0,
) -> list[EpisodeRecord]:
    """Play ``group_size`` rollouts of every task; rollout r of task g has group_id ``first_group_id + g``
    (a shard numbers its groups where they sit in the iteration). ``envs`` is an ``EpisodeBatch`` (kept
    open for the caller) or a suite, played in this process."""
    with as_batch(envs) as envs:
        starts = envs.reset_many([task for task in tasks for _ in range(group_size)])
        live: list[LiveEpisode] = []
        for slot, (obs, info) in enumerate(starts):
            g = slot // group_size
            rid = first_rollout_id + slot
            rec = EpisodeRecord(
                rid, first_group_id + g, tasks[g], settings.context, derive_seed(settings.seed, "sample", rid)
            )
            ep = LiveEpisode(rec, slot, obs, info, fmt.system(info.get("goal", "")))
            if "error" in info:
                end_with_error(ep, info["error"])
            live.append(ep)
        return play(live, envs, engine, fmt, settings, settings.seed)


@dataclass(frozen=True)
class Shard:
    """A fixed part of an iteration's rollouts: a block of its tasks, their rollout ids and a sampling seed.

    Fixed by the task list and the number of shards only, never by where a shard is played, so the
    same seed gives the same rollouts in this process or on a cluster."""

    index: int
    tasks: list[Task]
    first_group_id: int  # index of tasks[0] in the iteration's task list
    first_rollout_id: int
    seed: int
    group_size: int  # rollouts of each task


def split_shards(tasks: list[Task], n_shards: int, group_size: int, seed: int) -> list[Shard]:
    """Contiguous blocks of ``tasks`` (sizes differ by at most one; no empty shard), so the shards' records
    concatenated in order number groups and rollouts exactly as one unsharded ``collect`` does. With
    ``n_shards`` 1 the shard samples with ``seed`` itself (the unsharded stream); with more, shard s samples
    with its own ``derive_seed(seed, "shard", s)``, because the engine draws one stream per batch and shards
    sharing a seed would draw correlated actions."""
    n = min(n_shards, len(tasks))
    shards, start = [], 0
    for s in range(n):
        size = len(tasks) // n + (s < len(tasks) % n)
        shard_seed = seed if n_shards == 1 else derive_seed(seed, "shard", s)
        shards.append(Shard(s, tasks[start : start + size], start, start * group_size, shard_seed, group_size))
        start += size
    return shards


def sample_tasks(pool: list, n: int, seed: int, iteration: int) -> list:
    """The iteration's tasks: ``n`` distinct tasks of ``pool``, fixed by (seed, iteration)."""
    rng = random.Random(derive_seed(seed, "tasks", iteration))
    return rng.sample(pool, min(n, len(pool)))


def iteration_shards(pool: list[Task], rollout: RolloutConfig, seed: int, iteration: int) -> list[Shard]:
    """The iteration's ``rollout.tasks_per_iteration`` tasks drawn from the training ``pool``, fixed by (run
    ``seed``, iteration), in ``rollout.shards`` fixed shards: group and rollout ids and one sampling seed per
    shard, so the records do not depend on where shards play."""
    tasks = sample_tasks(pool, rollout.tasks_per_iteration, seed, iteration)
    return split_shards(tasks, rollout.shards, rollout.group_size, collect_seed(seed, iteration))


def collect_seed(seed: int, iteration: int) -> int:
    """The sampling seed of an iteration's rollouts (and of its branches), from the run's ``seed``."""
    return derive_seed(seed, "collect", iteration)


def play(
    live: list[LiveEpisode], envs: EpisodeBatch, engine: Engine, fmt: ChatFormat, settings: SamplingSettings, seed: int
) -> list[EpisodeRecord]:
    """Play every live episode until all are done or have ``settings.max_turns`` turns, sampling with
    ``seed``: in lockstep, or with ``settings.overlap`` as the two-half pipeline."""
    full = bool(live) and live[0].record.context == "full"
    sampling = _Sampling(engine, fmt, settings)
    if settings.overlap:
        _run_halves(live, envs, sampling, full, settings.max_turns, seed)
    else:
        _run_lockstep(live, envs, sampling, full, settings.max_turns, seed)
    for ep in live:
        if not ep.done:
            ep.record.status = "truncated"
    return [ep.record for ep in live]


def _run_lockstep(
    live: list[LiveEpisode], envs: EpisodeBatch, sampling: _Sampling, full: bool, max_turns: int, seed: int
) -> None:
    """Every episode still playing in each engine call, then one ``step_many``; one session (KV cache)
    across turns in full context."""
    session = sampling.engine.session() if full else None
    for step in range(max_turns):
        batch = [ep for ep in live if not ep.done and len(ep.record.turns) < max_turns]
        if not batch:
            break
        turn = _generate(batch, sampling, session, derive_seed(seed, "turn", step))
        t0 = time.perf_counter()
        results = envs.step_many(turn.sent())
        turn.env_s = time.perf_counter() - t0
        _record(turn, results)


def _run_halves(
    live: list[LiveEpisode], envs: EpisodeBatch, sampling: _Sampling, full: bool, max_turns: int, seed: int
) -> None:
    """The two-half pipeline: generate one half while the other half's step is in flight, then gather
    that step, send this half's, and swap. Each half has its own session (a session keeps only the
    episodes of its latest call, so halves cannot share one) and its own turn counter; it stops when it
    has no episode left to play or has played ``max_turns`` steps, and the loop ends when both have.

    If generation raises, the step in flight is gathered before the error propagates, so a batch the
    caller keeps (a pool reused by a retry) is left with no step in flight.
    """
    cut = math.ceil(len(live) / 2)
    halves = [live[:cut], live[cut:]]
    sessions = [sampling.engine.session() if full else None for _ in halves]
    steps = [0, 0]
    flight: _Turn | None = None  # the other half's turn while its step is in flight
    h, idle = (
        0,
        0,
    )  # idle: halves in a row with nothing to play; a half found idle stays idle (none of its steps is in flight)
    try:
        while idle < 2:
            batch = [ep for ep in halves[h] if not ep.done and len(ep.record.turns) < max_turns]
            turn = None
            if batch and steps[h] < max_turns:  # generated while ``flight`` steps
                turn = _generate(batch, sampling, sessions[h], derive_seed(seed, "turn", steps[h], h))
                steps[h] += 1
            if flight is not None:
                landed, flight = flight, None
                t0 = time.perf_counter()
                results = envs.step_finish()
                landed.env_s += time.perf_counter() - t0
                _record(landed, results)
            if turn is not None:
                t0 = time.perf_counter()
                envs.step_start(turn.sent())
                turn.env_s, flight = time.perf_counter() - t0, turn
            idle = 0 if turn is not None else idle + 1
            h = 1 - h
    except Exception:
        if flight is not None:
            envs.step_finish()
        raise


def _generate(batch: list[LiveEpisode], sampling: _Sampling, session: Session | None, seed: int) -> _Turn:
    """One engine call for every episode of ``batch``. ``deltas`` are what each turn row stores as prompt
    ids: the whole prompt in window context, only the new ids in full context (the session holds the
    rest)."""
    fmt, s = sampling.fmt, sampling.settings
    deltas, inputs, tries = [], [], []
    observations = fmt.users([ep.obs for ep in batch], [ep.info["admissible_commands"] for ep in batch])
    for ep, obs_ids in zip(batch, observations):
        if session is None:
            delta = window_prompt(fmt, ep.goal_ids, ep.history, obs_ids, s.history_turns)
        else:
            delta = full_delta(fmt, ep.goal_ids, obs_ids, ep.history[-1][1] if ep.history else None)
        pending = ep.pending.token_ids if ep.pending else []
        deltas.append(delta)
        inputs.append(ep.engine_prefix + delta + pending)
        ep.engine_prefix = []
        ep.history.append((obs_ids, []))
        tries.append(_trie(fmt, ep.info["admissible_commands"], pending) if s.action_mode == "admissible" else None)
    request = SampleRequest(inputs, tries, s.max_action_tokens, s.temperature, s.greedy, seed)
    t0 = time.perf_counter()
    if session is None:
        gens = sampling.engine.generate(request)
    else:
        gens = session.extend([ep.record.rollout_id for ep in batch], request)
    gen_s = (time.perf_counter() - t0) / len(batch)
    actions = []
    for ep, gen, trie in zip(batch, gens, tries):
        if ep.pending is not None:
            gen = _join(ep.pending, gen)
            ep.pending = None
        actions.append((gen, *_action_text(gen, trie, fmt)))
    broken = {ep.slot: _engine_fault(gen) for ep, (gen, _, _) in zip(batch, actions)}
    return _Turn(batch, deltas, actions, broken, gen_s, format_penalty=fmt.format_penalty)


def _record(turn: _Turn, results: dict[int, StepResult]) -> None:
    """Record ``turn``'s step results; an episode whose generation was broken ends as an error, unplayed."""
    results = {
        **results,
        **{
            ep.slot: ("", 0.0, True, error_info(ep.info, turn.broken[ep.slot]))
            for ep in turn.batch
            if turn.broken[ep.slot]
        },
    }
    env_s = turn.env_s / len(turn.batch)
    for ep, delta, (gen, action, format_valid) in zip(turn.batch, turn.deltas, turn.actions):
        _record_turn(
            ep,
            len(ep.record.turns),
            delta,
            gen,
            action,
            format_valid,
            results[ep.slot],
            turn.gen_s,
            env_s,
            turn.format_penalty,
        )


def _join(prefix: Generation, rest: Generation) -> Generation:
    """A branch's action: the parent's tokens up to the split, then the branch's own continuation."""
    return Generation(
        prefix.token_ids + rest.token_ids,
        prefix.logprobs + rest.logprobs,
        prefix.entropy + rest.entropy,
        prefix.policy_mask + rest.policy_mask,
        prefix.allowed + rest.allowed,
        rest.finished,
    )


def _engine_fault(gen: Generation) -> str:
    """Why a generation cannot be trained on or played ("" if it can): a non-finite sampling log-prob
    would poison the PPO ratio, so the episode ends as an error before its action is played; so does a
    generation the engine could not make (``Generation.error``: a vLLM server that died)."""
    if gen.error:
        return ENGINE_FAULT + gen.error
    bad = [i for i, (lp, m) in enumerate(zip(gen.logprobs, gen.policy_mask)) if m and not math.isfinite(lp)]
    return f"{ENGINE_FAULT}a non-finite log-prob at action token {bad[0]}" if bad else ""


def _action_text(gen: Generation, trie: TokenTrie | None, fmt: ChatFormat) -> tuple[str, bool]:
    """(command, format_valid): admissible mode takes the command's own text from the trie; free mode
    parses the decoded reply by the format's rule (``ChatFormat.parse_action``)."""
    if trie is not None and tuple(gen.token_ids) in trie.texts:
        return trie.texts[tuple(gen.token_ids)], True
    if trie is not None:  # cut at the token budget inside a command
        return fmt.tokenizer.decode(gen.token_ids, skip_special_tokens=True).strip(), False
    return fmt.parse_action(gen.token_ids, gen.finished)


def _record_turn(
    ep: LiveEpisode,
    turn: int,
    delta: list[int],
    gen: Generation,
    action: str,
    format_valid: bool,
    result: StepResult,
    gen_s: float,
    env_s: float,
    format_penalty: float,
) -> None:
    """Record one turn; a format error's step reward is lowered by ``format_penalty`` (rollout.format_penalty)."""
    obs, reward, done, info = result
    reward = float(reward) - (0.0 if format_valid else format_penalty)
    ep.history[-1] = (ep.history[-1][0], gen.token_ids)
    ep.record.turns.append(
        TurnRecord.of_step(turn, ep.obs, ep.info, action, delta, gen, reward, done, info, format_valid, gen_s, env_s)
    )
    ep.obs, ep.info = obs, info
    if "error" in info:
        end_with_error(ep, info["error"])
    elif done:
        ep.done = True
        ep.record.status = "won" if info.get("won") else "done"


def end_with_error(ep: LiveEpisode, why: str) -> None:
    """The environment failed (raised, crashed, hung or answered garbage): the episode ends here."""
    ep.done = True
    ep.record.status, ep.record.error = "error", why


def _trie(fmt: ChatFormat, commands: list[str], prefix: list[int]) -> TokenTrie:
    """The admissible commands as a trie, entered at the node after ``prefix`` (a branch's partial action)."""
    trie = TokenTrie([fmt.command(c) for c in commands], commands)
    for t in prefix:
        trie.root = trie.root[t]
    return trie
