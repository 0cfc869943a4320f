"""APPO's branches: planned over the collected initial rollouts (docs/algorithms.md §3.2-3.3, §6.4), then
replayed to their split and played on (``collect_branches``).

For every initial rollout the branching score is computed over its policy tokens, from the entropies the
engine recorded. Omega compares the current policy with the sampling policy; here the sampler *is* the
current policy (one model, no update in between), so Omega is constant by construction and the
documented fallback (BS = Z(H) where Z(H) > 0, docs/algorithms.md §6.4) applies; ``omega_fallback_fraction``
reports how often it did. Split points are never the last token of a turn's action, so a branch always
has something left to generate.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from horizonrl.engines.base import Engine, Generation
from horizonrl.envs.base import EnvSuite
from horizonrl.envs.batch import EpisodeBatch, as_batch
from horizonrl.rollout.loop import LiveEpisode, SamplingSettings, end_with_error, play
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.rollout.records import EpisodeRecord
from horizonrl.seeding import derive_seed
from methods.appo import BranchingParams, branching_score, select_branch_points


@dataclass(frozen=True)
class BranchStart:
    """Where a branch leaves its parent: after action token ``split`` (flat over all its turns). A split on
    the last token of a turn's action (or -1, before the first) starts the next turn afresh: APPO never
    splits there (``plan_branches``), the credit audit's continuations always do (``turn_start``)."""

    parent: EpisodeRecord
    split: int
    score: float = 0.0  # branching score at the split


def turn_start(parent: EpisodeRecord, turn: int) -> BranchStart:
    """A branch that replays ``parent``'s first ``turn`` turns and samples every turn from ``turn`` on."""
    return BranchStart(parent, sum(len(t.gen.token_ids) for t in parent.turns[:turn]) - 1)


def _policy_tokens(ep: EpisodeRecord, tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(flat index, entropy, sampling log-prob, is_candidate) over the rollout's policy tokens."""
    flat, ent, logp, cand, offset = [], [], [], [], 0
    for t in ep.turns:
        g = t.gen
        for j, is_policy in enumerate(g.policy_mask):
            if is_policy:
                flat.append(offset + j)
                ent.append(g.entropy[j])
                logp.append(g.logprobs[j])
                last = j == len(g.token_ids) - 1
                cand.append(not last and bool(tokenizer.decode([g.token_ids[j]]).strip()))
        offset += len(g.token_ids)
    return np.asarray(flat, dtype=np.int64), np.asarray(ent), np.asarray(logp), np.asarray(cand, dtype=bool)


def plan_branches(
    initial: list[EpisodeRecord], budget: int, params: BranchingParams, tokenizer
) -> tuple[list[BranchStart], list[float], dict[str, float]]:
    """Branch starts for every task group (``budget`` per group), their scores, and planning figures."""
    groups: dict[int, list[EpisodeRecord]] = defaultdict(list)
    for ep in initial:
        groups[ep.group_id].append(ep)
    starts, scores = [], []
    counts = {"strict": 0, "fallback": 0, "cyclic": 0, "dropped": 0}
    fallbacks = 0
    for gid in sorted(groups):
        eps = groups[gid]
        tokens = [_policy_tokens(ep, tokenizer) for ep in eps]
        # sampler == scorer here, so logp_cur = logp_roll: Omega is exactly constant (see module docstring)
        bs = [branching_score(ent, logp, logp, params) for _, ent, logp, _ in tokens]
        fallbacks += sum(b.omega_fallback for b in bs)
        selection = select_branch_points(bs, [c for *_, c in tokens], budget)
        for key, n in selection.counts.items():
            counts[key] += n
        for p in selection.points:
            starts.append(BranchStart(eps[p.rollout], int(tokens[p.rollout][0][p.split]), float(p.score)))
            scores.append(p.score)
    n_groups = max(len(groups), 1)
    stats = {f"branch_{k}": v / n_groups for k, v in counts.items()}
    stats.update(
        branches_per_group=len(starts) / n_groups,
        omega_fallback_fraction=fallbacks / max(len(initial), 1),
        mean_branching_score=float(np.mean(scores)) if scores else 0.0,
    )
    return starts, scores, stats


def collect_branches(
    envs: EpisodeBatch | EnvSuite,
    starts: list[BranchStart],
    engine: Engine,
    fmt: ChatFormat,
    settings: SamplingSettings,
    *,
    first_rollout_id: int,
    kind: str = "branch",
) -> list[EpisodeRecord]:
    """Play branches (APPO's; the audit's continuations, ``kind`` "audit"): each continues its parent from
    the token prefix up to and including the split token (within that turn, or a fresh turn after it), in
    an environment brought to the parent's state at that turn by replaying the parent's earlier actions
    (all replays step together). All branches are generated in one lockstep batch, or in the two-half
    pipeline with ``settings.overlap``. A replay whose observations differ from the parent's raises: the
    environment is not deterministic, and a branch from a different state would get the wrong credit."""
    with as_batch(envs) as envs:
        split_turns = [_split_turn(b) for b in starts]
        resets = envs.reset_many([b.parent.task for b in starts])
        replayed: list[tuple[str, dict]] = []
        offered: list[list[list[str]]] = []  # per branch: the admissible commands of each replayed turn
        for b, (obs, info) in zip(starts, resets):
            _check_replay(b.parent, 0, obs, info)
            replayed.append((obs, info))
            offered.append([info.get("admissible_commands", [])])
        for t in range(max((turn for turn, _ in split_turns), default=0)):
            todo = {
                i: b.parent.turns[t].action
                for i, b in enumerate(starts)
                if t < split_turns[i][0] and "error" not in replayed[i][1]
            }
            for i, (obs, _, _, info) in envs.step_many(todo).items():
                _check_replay(starts[i].parent, t + 1, obs, info)
                replayed[i] = (obs, info)
                offered[i].append(info.get("admissible_commands", []))
        live = []
        for i, (b, (turn, kept)) in enumerate(zip(starts, split_turns)):
            live.append(
                _branch_live(
                    b,
                    turn,
                    kept,
                    i,
                    *replayed[i],
                    offered[i],
                    fmt,
                    settings.context,
                    first_rollout_id + i,
                    settings.seed,
                    kind,
                )
            )
        return play(live, envs, engine, fmt, settings, derive_seed(settings.seed, "branches"))


def _split_turn(b: BranchStart) -> tuple[int, int]:
    """(turn, how many of that turn's action tokens the branch keeps) of the flat split index; a split on
    the last token of a turn keeps none of the next one (a fresh turn)."""
    lengths = [len(t.gen.token_ids) for t in b.parent.turns]
    turn, kept = 0, b.split + 1
    while turn < len(lengths) and kept >= lengths[turn]:
        kept -= lengths[turn]
        turn += 1
    return turn, kept


def _check_replay(parent: EpisodeRecord, turn: int, obs: str, info: dict) -> None:
    if "error" not in info and obs != parent.turns[turn].observation:
        raise RuntimeError(
            f"replay of rollout {parent.rollout_id} diverged at turn {turn}: the environment is not deterministic"
        )


def _branch_live(
    b: BranchStart,
    turn: int,
    kept: int,
    slot: int,
    obs: str,
    info: dict,
    offered: list[list[str]],
    fmt: ChatFormat,
    context: str,
    rollout_id: int,
    seed: int,
    kind: str,
) -> LiveEpisode:
    """The branch as a live episode at its split turn, holding the ``kept`` first tokens of that turn's action
    (none: a fresh turn); its window history is rebuilt from the parent's turns, each observation with the
    commands ``offered`` at that turn (the ``listed`` prompt shows them)."""
    parent = b.parent
    rec = EpisodeRecord(
        rollout_id,
        parent.group_id,
        parent.task,
        context,
        derive_seed(seed, "sample", rollout_id),
        kind=kind,
        parent_rollout=parent.rollout_id,
        branch_token=b.split,
        branch_score=b.score,
        turns=list(parent.turns[:turn]),
    )
    pending = None
    if kept:
        g = parent.turns[turn].gen
        pending = Generation(
            g.token_ids[:kept], g.logprobs[:kept], g.entropy[:kept], g.policy_mask[:kept], g.allowed[:kept]
        )
    ep = LiveEpisode(
        rec,
        slot,
        obs,
        info,
        fmt.system(info.get("goal", "")),
        [(fmt.user(t.observation, cmds), t.gen.token_ids) for t, cmds in zip(rec.turns, offered)],
        pending=pending,
    )
    if context == "full":
        ep.engine_prefix = [i for t in rec.turns for i in t.prompt_ids + t.gen.token_ids]
    if "error" in info:
        end_with_error(ep, info["error"])
    return ep
