"""Step 2 of the credit audit: the decision points, drawn at random from the turns of the groups it played
(docs/algorithms.md §8.1).

A decision point is a turn (episode, t) at which the policy chose: at least one of its action tokens was
sampled from more than one allowed token (turns whose action was forced are no decision, their advantage
is 0 by definition). Episodes that ended in an environment error are left out, as the estimators leave them
out. The draw has two parts, both fixed by the seed:

* anchor states (GiGPO's: one observation that several episodes of a group reached): states left by at
  least two different actions, in random order, one point per action, up to ``anchor_share`` of the points,
  so that the ordering test has pairs of actions to order;
* the rest stratified over (task family, phase, outcome), phase the turn's third of its episode (early,
  middle, late), outcome whether the episode was won: strata in random order, one point from each in turn,
  until the count is reached, so every family, phase and outcome appears before any stratum gets a second
  point. The outcome is a stratum because a policy's decisions in won and lost episodes differ most in their
  Monte Carlo advantage: drawn in proportion, a policy that wins one episode in five would leave few points
  where continuations end differently, and a correlation over them would rest on ties.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

PHASES = ("early", "middle", "late")


def phase(turn: int, n_turns: int) -> str:
    """The third of its episode a turn falls in: ``PHASES[floor(3 t / n)]``."""
    return PHASES[min(2, 3 * turn // max(n_turns, 1))]


def candidates(episodes: pa.Table, turns: pa.Table) -> pd.DataFrame:
    """Every decision of the played initial rollouts, one row per (rollout_id, turn) in that order, with its
    group, task, family, episode length and outcome (``won``), phase, observation and action."""
    played = episodes.filter(pc.and_(pc.equal(episodes["kind"], "initial"), pc.not_equal(episodes["status"], "error")))
    eps = played.select(["rollout_id", "task_id", "family", "n_turns", "won"]).to_pandas()
    rows = turns.select(["rollout_id", "group_id", "turn", "observation", "action", "policy_mask"]).to_pandas()
    rows = rows[[any(mask) for mask in rows["policy_mask"]]].drop(columns="policy_mask")
    frame = rows.merge(eps, on="rollout_id").sort_values(["rollout_id", "turn"], ignore_index=True)
    frame["phase"] = [phase(t, n) for t, n in zip(frame["turn"], frame["n_turns"])]
    return frame


def anchor_codes(frame: pd.DataFrame) -> np.ndarray:
    """(N,) int64: a code per anchor state (same group, same observation) that the rows of ``frame`` left by
    at least two different actions, shared by those rows; -1 for every other row."""
    state = frame.groupby(["group_id", "observation"], sort=True).ngroup().to_numpy()
    actions = frame.groupby(["group_id", "observation"], sort=True)["action"].transform("nunique").to_numpy()
    kept = np.where(actions >= 2, state, -1)
    codes = {c: k for k, c in enumerate(sorted(set(kept[kept >= 0])))}
    return np.array([codes.get(c, -1) for c in kept], dtype=np.int64)


def pick_points(frame: pd.DataFrame, n: int, anchor_share: float, seed: int) -> pd.DataFrame:
    """``n`` decision points of ``candidates``' ``frame`` (all if it has fewer), drawn as the module says, in
    (rollout_id, turn) order, numbered by ``point``, with ``anchor`` the anchor state each shares with another
    point left by another action (-1 none)."""
    rng = np.random.default_rng(seed)
    frame = frame.reset_index(drop=True)
    chosen = _anchor_draw(frame, round(anchor_share * min(n, len(frame))), rng)
    rest = frame.index.difference(chosen)
    chosen += _stratified_draw(frame.loc[rest], n - len(chosen), rng)
    points = frame.loc[chosen].sort_values(["rollout_id", "turn"], ignore_index=True)
    points.insert(0, "point", np.arange(len(points), dtype=np.int32))
    points["anchor"] = anchor_codes(points)
    return points


def _anchor_draw(frame: pd.DataFrame, quota: int, rng: np.random.Generator) -> list[int]:
    """Row labels: anchor states in random order, one random row per distinct action, while they fit."""
    code = anchor_codes(frame)
    chosen: list[int] = []
    for state in rng.permutation(np.unique(code[code >= 0])):
        rows = frame[code == state]
        picks = [int(rng.choice(g.index)) for _, g in rows.groupby("action", sort=True)]
        room = quota - len(chosen)
        if room < 2:
            break
        chosen += picks[:room]
    return chosen


def _stratified_draw(frame: pd.DataFrame, n: int, rng: np.random.Generator) -> list[int]:
    """Row labels: one from each (family, phase, outcome) stratum in turn, strata and rows in random order."""
    strata = [list(rng.permutation(g.index)) for _, g in frame.groupby(["family", "phase", "won"], sort=True)]
    strata = [strata[k] for k in rng.permutation(len(strata))]
    chosen: list[int] = []
    while len(chosen) < n and any(strata):
        for rows in strata:
            if rows and len(chosen) < n:
                chosen.append(int(rows.pop()))
    return chosen


def branch_turns(episodes: pa.Table, turns: pa.Table) -> set[tuple[int, int]]:
    """(parent rollout, turn) of every APPO branch's split: the turns whose tokens hold one of APPO's own
    decision points, where its branch credit is the credit of that very decision."""
    lengths: dict[int, list[int]] = {}
    cols = turns.select(["rollout_id", "turn", "action_ids"]).to_pydict()
    for rid, _, ids in sorted(zip(cols["rollout_id"], cols["turn"], cols["action_ids"]), key=lambda r: r[:2]):
        lengths.setdefault(rid, []).append(len(ids))
    out = set()
    branches = episodes.filter(pc.equal(episodes["kind"], "branch")).select(["parent_rollout", "branch_token"])
    for parent, split in zip(*branches.to_pydict().values()):
        ends = np.cumsum(lengths[parent])  # (turns,) flat index after each turn's last token
        out.add((int(parent), int(np.searchsorted(ends, split, side="right"))))
    return out
