"""Step 3 of the credit audit: the Monte Carlo truth at each decision point (docs/algorithms.md §8.2).

At point (episode, t) the audit plays 2M continuations, each replaying the episode's first turns in a fresh
environment (``rollout.branching``: the replay APPO's branches use, checked observation by observation):

* M with the action a_t fixed: the first t + 1 turns replayed, sampled from turn t + 1 on. Where the episode
  ended with turn t (done, or the horizon), there is nothing to play: all M returns are r_t;
* M with a fresh action: the first t turns replayed, sampled from turn t on.

The return of a continuation is its reward from turn t on (the training reward: the environment's, less the
format penalty of a bad reply), so Q(s_t, a_t) - V(s_t) leaves out the rewards before t that both share.
Points play in blocks of ``block_points``: a block's continuations are one batch of the engine, and its
episodes are stored before the next block plays, so an audit resumed after a kill plays only what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from horizonrl.audit.statistics import mc_advantage, split_halves
from horizonrl.engines.base import Engine
from horizonrl.envs.batch import EpisodeBatch
from horizonrl.rollout.branching import collect_branches, turn_start
from horizonrl.rollout.loop import SamplingSettings
from horizonrl.rollout.prompting import ChatFormat
from horizonrl.rollout.records import ENGINE_FAULT, EpisodeRecord

FRESH, FIXED = "fresh", "fixed"


@dataclass(frozen=True)
class Continuation:
    """One continuation of a block: its point, arm (``FRESH`` or ``FIXED``), parent and first sampled turn."""

    point: int
    arm: str
    parent: int  # rollout id of the episode the point is a turn of
    start: int  # first turn it samples (t for FRESH, t + 1 for FIXED)


def plan(points: pd.DataFrame, parents: dict[int, EpisodeRecord], m: int) -> list[Continuation]:
    """The continuations of ``points`` (rows with ``point``, ``rollout_id``, ``turn``) in play order: per point M
    fresh, then M fixed unless the episode ended with turn t (nothing left to play)."""
    out = []
    for p, rid, t in zip(points["point"], points["rollout_id"], points["turn"]):
        out += [Continuation(int(p), FRESH, int(rid), int(t))] * m
        if t + 1 < len(parents[int(rid)].turns):
            out += [Continuation(int(p), FIXED, int(rid), int(t) + 1)] * m
    return out


def play_block(
    envs: EpisodeBatch,
    parents: dict[int, EpisodeRecord],
    continuations: list[Continuation],
    engine: Engine,
    fmt: ChatFormat,
    settings: SamplingSettings,
    first_rollout_id: int,
) -> list[EpisodeRecord]:
    """Play a block's continuations in one batch (episodes of kind ``audit``, numbered from ``first_rollout_id``)."""
    starts = [turn_start(parents[c.parent], c.start) for c in continuations]
    return collect_branches(envs, starts, engine, fmt, settings, first_rollout_id=first_rollout_id, kind="audit")


def matches(episodes: pa.Table, continuations: list[Continuation], parents: dict, first_rollout_id: int) -> bool:
    """Whether a stored block's ``episodes`` are exactly these continuations (ids, parents and splits, in order),
    each played out (none ended by the sampler: a dead server's episodes are no returns)."""
    cols = episodes.select(["rollout_id", "parent_rollout", "branch_token", "error"]).to_pydict()
    want = [turn_start(parents[c.parent], c.start) for c in continuations]
    return (
        cols["rollout_id"] == list(range(first_rollout_id, first_rollout_id + len(continuations)))
        and cols["parent_rollout"] == [c.parent for c in continuations]
        and cols["branch_token"] == [s.split for s in want]
        and not any(e.startswith(ENGINE_FAULT) for e in cols["error"])
    )


def returns(
    points: pd.DataFrame,
    parents: dict[int, EpisodeRecord],
    continuations: list[Continuation],
    episodes: pa.Table,
    m: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(q, v): (P, M) returns from turn t of the fixed and the fresh arm, in the order of ``points``; NaN for
    a continuation that ended in an error. ``episodes``: the continuations' rows, in ``continuations`` order."""
    row = {int(p): k for k, p in enumerate(points["point"])}
    q = np.full((len(points), m), np.nan)
    v = np.full((len(points), m), np.nan)
    for p, rid, t in zip(points["point"], points["rollout_id"], points["turn"]):
        if t + 1 >= len(parents[int(rid)].turns):  # the episode ended with turn t: Q is its reward
            q[row[int(p)]] = parents[int(rid)].turns[int(t)].reward
    filled = {(k, arm): 0 for k in range(len(points)) for arm in (FRESH, FIXED)}
    cols = episodes.select(["episode_return", "status"]).to_pydict()
    for c, total, status in zip(continuations, cols["episode_return"], cols["status"]):
        k = row[c.point]
        t = c.start if c.arm == FRESH else c.start - 1
        before = sum(turn.reward for turn in parents[c.parent].turns[:t])  # rewards both arms share
        (v if c.arm == FRESH else q)[k, filled[k, c.arm]] = np.nan if status == "error" else total - before
        filled[k, c.arm] += 1
    return q, v


POINT_COLUMNS = ("point", "rollout_id", "group_id", "turn", "n_turns", "task_id", "family", "phase", "anchor", "action")


def empty_truth(points: pd.DataFrame) -> dict[str, list]:
    """The points table's columns (``store.AUDIT``) for freshly drawn ``points``: no returns, no figures yet."""
    n = len(points)
    return {
        **{c: points[c].tolist() for c in POINT_COLUMNS},
        "q_returns": [[] for _ in range(n)],
        "v_returns": [[] for _ in range(n)],
        **{c: [float("nan")] * n for c in ("q_mc", "v_mc", "a_mc", "se", "a_half1", "a_half2")},
    }


def with_truth(points: pd.DataFrame, q: list[np.ndarray], v: list[np.ndarray]) -> dict[str, list]:
    """The points table's columns with each point's returns (blocks of (P_b, M) arrays, in point order) and
    the Monte Carlo figures computed from them (``statistics.mc_advantage``, ``split_halves``)."""
    q_all, v_all = np.concatenate(q), np.concatenate(v)
    q_mc, v_mc, a_mc, se = mc_advantage(q_all, v_all)
    half1, half2 = split_halves(q_all, v_all)
    figures = {"q_mc": q_mc, "v_mc": v_mc, "a_mc": a_mc, "se": se, "a_half1": half1, "a_half2": half2}
    return {
        **{c: points[c].tolist() for c in POINT_COLUMNS},
        "q_returns": q_all.tolist(),
        "v_returns": v_all.tolist(),
        **{c: x.tolist() for c, x in figures.items()},
    }
