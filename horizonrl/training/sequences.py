"""From stored tables to what the estimators and the learner consume.

* ``step_batch``: the turns table as a ``methods.StepBatch`` (one row per decision, layout S columns).
* ``train_rows``: the exact token sequences the policy saw, with policy positions, their sampling
  log-probs, allowed sets and per-token advantages. ``full`` context gives one row per trajectory
  (layout T); ``window`` context one row per turn (layout S).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from methods import StepBatch


@dataclass
class TrainRow:
    """One training sequence. Policy lists have one entry per policy token (mask = 1)."""

    rollout_id: int
    turn: int  # -1 for a whole trajectory (layout T)
    input_ids: list[int]  # (L,)
    positions: list[int]  # (P,) index in input_ids of each policy token (predicted from position - 1)
    allowed: list[list[int]]  # (P, *) candidate ids; [] = full vocabulary
    sample_logp: list[float]  # (P,) log-prob at sampling time
    turn_id: list[int]  # (P,) turn of each policy token
    flat_index: list[int]  # (P,) index among the trajectory's action tokens (all turns, in order)
    adv: list[float] | None = None  # (P,) filled by ``attach_advantages``


def _sorted_turns(turns: pa.Table) -> dict[str, list]:
    order = np.lexsort((turns["turn"].to_numpy(), turns["rollout_id"].to_numpy()))
    return turns.take(pa.array(order)).to_pydict()


def train_rows(turns: pa.Table, context: str) -> list[TrainRow]:
    """Rebuild every sequence; ``full`` concatenates each trajectory's turns (prompt deltas + actions)."""
    cols = _sorted_turns(turns)
    rows: list[TrainRow] = []
    current: TrainRow | None = None
    flat = 0
    for i in range(len(cols["rollout_id"])):
        rid, turn = cols["rollout_id"][i], cols["turn"][i]
        new_traj = current is None or current.rollout_id != rid
        if new_traj:
            flat = 0
        if context == "window" or new_traj:
            current = TrainRow(
                rollout_id=rid,
                turn=turn if context == "window" else -1,
                input_ids=[],
                positions=[],
                allowed=[],
                sample_logp=[],
                turn_id=[],
                flat_index=[],
            )
            rows.append(current)
        prompt, action = cols["prompt_ids"][i], cols["action_ids"][i]
        current.input_ids.extend(prompt)
        start = len(current.input_ids)
        current.input_ids.extend(action)
        allowed = cols["allowed"][i]
        for j, is_policy in enumerate(cols["policy_mask"][i]):
            if is_policy:
                current.positions.append(start + j)
                current.allowed.append(allowed[j] if allowed else [])
                current.sample_logp.append(cols["logprobs"][i][j])
                current.turn_id.append(turn)
                current.flat_index.append(flat + j)
        flat += len(action)
    return rows


def attach_advantages(rows: list[TrainRow], adv_table: pa.Table) -> list[TrainRow]:
    """Give each policy token its advantage; drop tokens of turns the estimator did not keep.

    Rows left with no policy token are dropped (they would only add to loss denominators).
    """
    a = adv_table.to_pydict()
    per_turn = {(r, t): (v, k) for r, t, v, k in zip(a["rollout_id"], a["turn"], a["adv"], a["keep"])}
    per_traj = {r: toks for r, toks in zip(a["rollout_id"], a["adv_tokens"]) if toks is not None}
    out = []
    for row in rows:
        keep_idx, adv = [], []
        for p, (t, f) in enumerate(zip(row.turn_id, row.flat_index)):
            value, keep = per_turn[(row.rollout_id, t)]
            if keep:
                keep_idx.append(p)
                adv.append(per_traj[row.rollout_id][f] if row.rollout_id in per_traj else value)
        if keep_idx:
            out.append(
                TrainRow(
                    rollout_id=row.rollout_id,
                    turn=row.turn,
                    input_ids=row.input_ids,
                    positions=[row.positions[p] for p in keep_idx],
                    allowed=[row.allowed[p] for p in keep_idx],
                    sample_logp=[row.sample_logp[p] for p in keep_idx],
                    turn_id=[row.turn_id[p] for p in keep_idx],
                    flat_index=[row.flat_index[p] for p in keep_idx],
                    adv=adv,
                )
            )
    return out


def step_batch(episodes: pa.Table, turns: pa.Table, update_index: int) -> StepBatch:
    """The turns table as estimator input; rows contiguous per trajectory, in turn order."""
    cols = _sorted_turns(turns)
    ep = episodes.to_pydict()
    by_rollout = {r: i for i, r in enumerate(ep["rollout_id"])}
    idx = [by_rollout[r] for r in cols["rollout_id"]]

    def ep_col(name: str, dtype) -> np.ndarray:
        return np.asarray([ep[name][i] for i in idx], dtype=dtype)

    obs = np.asarray(cols["observation"], dtype=object)
    family = ep_col("family", object)
    # full context: a later turn's prompt ids (the previous action's close + the observation) lie between
    # two actions of the one response; window context: each turn is its own sequence
    full = ep_col("context", object) == "full"
    gap = [len(p) if f and t > 0 else 0 for p, f, t in zip(cols["prompt_ids"], full, cols["turn"])]
    return StepBatch(
        group_id=np.asarray(cols["group_id"], dtype=np.int64),
        traj_id=np.asarray(cols["rollout_id"], dtype=np.int64),
        turn=np.asarray(cols["turn"], dtype=np.int64),
        reward=np.asarray(cols["reward"], dtype=np.float64),
        episode_return=ep_col("episode_return", np.float64),
        n_tokens=np.asarray([len(a) for a in cols["action_ids"]], dtype=np.int64),
        update_index=update_index,
        anchor_obs=obs,
        action=np.asarray(cols["action"], dtype=object),
        valid=np.asarray(cols["valid"], dtype=bool),
        format_valid=np.asarray(cols["format_valid"], dtype=bool),
        progress_key=np.asarray(cols["progress_key"], dtype=object),
        abstract_action=np.asarray(cols["abstract_action"], dtype=object),
        context_id=np.asarray([f"{f}|{o}" for f, o in zip(family, obs)], dtype=object),
        shareable=np.ones(len(obs), dtype=bool),
        kind=np.asarray([1 if k == "branch" else 0 for k in ep_col("kind", object)], dtype=np.int8),
        parent_traj=ep_col("parent_rollout", np.int64),
        branch_token=ep_col("branch_token", np.int64),
        gap_tokens=np.asarray(gap, dtype=np.int64),
        extras={"branch_score": ep_col("branch_score", np.float64)},  # APPO's reward-scale factor M
    )
