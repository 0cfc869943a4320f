"""Target 3: advantage estimators at scale against a plain per-group Python loop over the same data.

The batch is step-level (``rows`` turn rows in ``groups`` task groups, K trajectories of T turns each)
with every column GiGPO and BLPO read, so the trajectory-level estimators pay for collapsing rows to
trajectories as they do in a run. BLPO starts from a memory written by one earlier update over the same
roles (about ``keys`` (role, abstract action) records), untimed.

The references are honest plain Python: one pass that files row indices under their group, then a loop
over groups doing the arithmetic on Python floats. BLPO's reference keeps the memory as plain records
((role, action) -> ``MomentRecord``, converted from the estimator's memory untimed), writes them key by
key and reads them role by role (``role_progress_advantage``), as ``BLPOMemory`` did before it ran on
columns. Every reference is checked against its estimator (BLPO's memory too) before a time is reported.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

import methods
from benchmarks.report import Figure
from methods import StepBatch
from methods.blpo import BLPOParams
from methods.blpo_memory import BLPOMemory, MomentRecord, context_hashes, role_progress_advantage
from methods.gigpo import GiGPOParams
from methods.stepwise import normalize_action_text

TURNS = 2
LIMITS = {"loo": 0.5, "grpo": 0.5, "rloo": 0.5, "gigpo": 2.0, "blpo": 5.0}


def make_batch(rows: int, groups: int, keys: int, update_index: int, seed: int = 0) -> StepBatch:
    """K = rows / (groups * T) trajectories per group; two abstract actions per role, so about
    ``keys`` memory keys over ``keys / 2`` roles. Turn 0 shares one observation per group (an anchor /
    Exact group of K rows), turn 1's observation depends on the turn-0 action."""
    k = max(rows // (groups * TURNS), 1)
    n = groups * k * TURNS
    rng = np.random.default_rng(seed)
    row = np.arange(n)
    group, traj, turn = row // (k * TURNS), row // TURNS, row % TURNS
    act = rng.integers(0, 3, n)  # concrete action 0..2; abstract action = act % 2
    prev = np.where(turn == 1, np.roll(act, 1), -1)
    won = rng.random(n // TURNS) < 0.4
    reward = np.where(turn == TURNS - 1, won[traj], 0.0).astype(np.float64)
    obs = [f"g{g} t{t} a{a}" for g, t, a in zip(group.tolist(), turn.tolist(), prev.tolist())]
    n_roles = max(keys // 2, 1)
    roles = ((group * TURNS + turn) % n_roles).tolist()
    return StepBatch(
        group_id=group,
        traj_id=traj,
        turn=turn,
        reward=reward,
        episode_return=won[traj].astype(np.float64),
        n_tokens=np.full(n, 4, np.int64),
        update_index=update_index,
        anchor_obs=np.asarray(obs, dtype=object),
        action=np.asarray([f"Go To  shelf {a}" for a in act.tolist()], dtype=object),
        valid=rng.random(n) > 0.05,
        format_valid=np.ones(n, bool),
        progress_key=np.asarray([f"role {r}" for r in roles], dtype=object),
        abstract_action=np.asarray([f"move {a % 2}" for a in act.tolist()], dtype=object),
        context_id=np.asarray([f"household|{o}" for o in obs], dtype=object),
        shareable=np.ones(n, bool),
    )


def _group_by(idx: Iterable[int], keys: list) -> dict[Any, list[int]]:
    """The rows ``idx`` grouped by ``keys[i]`` in first-seen order: every grouping step of the plain loops."""
    out: dict[Any, list[int]] = defaultdict(list)
    for i in idx:
        out[keys[i]].append(i)
    return out


def _members(batch: StepBatch) -> dict[int, list[int]]:
    return _group_by(range(len(batch)), batch.group_id.tolist())


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and unbiased std of a Python list (std 0 for one value)."""
    m = sum(values) / len(values)
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return m, math.sqrt(var)


def loop_trajectory(name: str, batch: StepBatch) -> list[float]:
    """LOO / GRPO / RLOO with default params: per group, one return per trajectory, plain floats."""
    ret, traj = batch.episode_return.tolist(), batch.traj_id.tolist()
    out = [0.0] * len(batch)
    for idx in _members(batch).values():
        by_traj = _group_by(idx, traj)
        r = {t: ret[rows[0]] for t, rows in by_traj.items()}
        k = len(r)
        m, s = _mean_std(list(r.values()))
        for t, rows in by_traj.items():
            if name == "loo":
                a = 0.0 if k < 2 else k / (k - 1) * (r[t] - m)
            elif name == "rloo":
                a = r[t] if k < 2 else k / (k - 1) * (r[t] - m)
            else:
                a = r[t] / (1 + 1e-6) if k < 2 else (r[t] - m) / (s + 1e-6)
            for i in rows:
                out[i] = a
    return out


def _returns(idx: list[int], traj: list[int], reward: list[float], gamma: float) -> dict[int, float]:
    """Discounted step returns G of the rows ``idx`` (contiguous trajectories in turn order)."""
    g: dict[int, float] = {}
    for n in range(len(idx) - 1, -1, -1):
        i = idx[n]
        following = idx[n + 1] if n + 1 < len(idx) and traj[idx[n + 1]] == traj[i] else None
        g[i] = reward[i] + gamma * (g[following] if following is not None else 0.0)
    return g


def _penalized(batch: StepBatch, p: float) -> tuple[list[float], list[float]]:
    valid = batch.valid.tolist()
    score = [r - p * (not v) for r, v in zip(batch.episode_return.tolist(), valid)]
    reward = [r - p * (not v) for r, v in zip(batch.reward.tolist(), valid)]
    return score, reward


def loop_gigpo(batch: StepBatch, p: GiGPOParams) -> list[float]:
    """GiGPO (mean_std_norm, cross_steps): episode term over the group's rows, step term per anchor."""
    score, reward = _penalized(batch, p.invalid_penalty)
    traj, obs = batch.traj_id.tolist(), batch.anchor_obs.tolist()
    out = [0.0] * len(batch)
    for idx in _members(batch).values():
        m, s = _mean_std([score[i] for i in idx]) if len(idx) > 1 else (0.0, 1.0)
        g = _returns(idx, traj, reward, p.gamma)
        for rows in _group_by(idx, obs).values():
            am, asd = _mean_std([g[i] for i in rows])
            for i in rows:
                out[i] = (score[i] - m) / (s + p.eps) + ((g[i] - am) / (asd + p.eps) if len(rows) > 1 else 0.0)
    return out


def loop_blpo(batch: StepBatch, p: BLPOParams, records: dict, decay: float) -> tuple[list[float], dict]:
    """BLPO with default params: per group the episode term, the action-balanced Exact term and the
    child-balanced effects; then one memory write per key and one read per role, on plain records
    ((role, action) -> ``MomentRecord``) decayed at ``decay`` per update."""
    score, reward = _penalized(batch, p.invalid_penalty)
    traj, obs, valid = batch.traj_id.tolist(), batch.anchor_obs.tolist(), batch.valid.tolist()
    fmt, role, abstract, context = (
        c.tolist() for c in (batch.format_valid, batch.progress_key, batch.abstract_action, batch.context_id)
    )
    texts = batch.action.tolist()
    normal = {t: normalize_action_text(t) for t in set(texts)}  # each distinct action text normalised once
    action = [(0 if v else 1) if f else 2 for v, f in zip(valid, fmt)]
    action = [(a, normal[t]) for a, t in zip(action, texts)]
    n = len(batch)
    episode, exact, exact_on = [0.0] * n, [0.0] * n, [False] * n
    effects: dict[tuple[str, str], list] = {}  # key -> [W, S, Q, {context: weight}]
    for idx in _members(batch).values():
        if len(idx) > 1:
            m, s = _mean_std([score[i] for i in idx])
            for i in idx:
                episode[i] = (score[i] - m) / (s + p.eps)
        g = _returns(idx, traj, reward, p.gamma)
        for rows in _group_by(idx, obs).values():
            m, s = _mean_std([g[i] for i in rows])
            per_action: dict[tuple, list[float]] = defaultdict(list)
            for i in rows:
                per_action[action[i]].append(g[i])
            dev = {a: sum(v) / len(v) - m for a, v in per_action.items()}
            if len(rows) >= 2 and s * s > p.eps**2 and any(abs(d) > p.eps for d in dev.values()):
                for i in rows:
                    exact[i], exact_on[i] = dev[action[i]] / (s + p.eps), True
            if len(rows) >= 2 and len({abstract[i] for i in rows}) >= 2:
                buckets: dict[tuple, list[float]] = defaultdict(list)
                for i in rows:
                    buckets[(role[i], abstract[i], context[i])].append(g[i] - m)
                for (r, a, c), deltas in buckets.items():
                    e = sum(deltas) / len(deltas)
                    rec = effects.setdefault((r, a), [0.0, 0.0, 0.0, {}])
                    rec[0], rec[1], rec[2] = rec[0] + 1.0, rec[1] + e, rec[2] + e * e
                    rec[3][c] = rec[3].get(c, 0.0) + 1.0
    update = int(batch.update_index)
    records = plain_write(records, decay, update, effects)
    by_role: dict[str, list[str]] = {}  # role -> its actions, sorted
    for r, a in sorted(records):
        by_role.setdefault(r, []).append(a)
    reads = {}
    out = []
    for i in range(n):
        if role[i] not in reads:
            decayed = (records[(role[i], a)].decayed(update, decay) for a in by_role.get(role[i], ()))
            reads[role[i]] = role_progress_advantage(
                {a: d_ for a, d_ in zip(by_role.get(role[i], ()), decayed) if d_.W > p.eps}, p.progress_read
            )
        read = reads[role[i]]
        on = read.active and abstract[i] in read.score
        w_x, w_p = p.exact_prior * exact_on[i], p.role_prior * on
        micro = (w_x * exact[i] + w_p * read.adv.get(abstract[i], 0.0) * on) / (w_x + w_p) if w_x + w_p > 0 else 0.0
        out.append(episode[i] + p.step_advantage_w * micro)
    return out, records


def plain_write(records: dict, decay: float, update: int, effects: dict) -> dict:
    """The memory write as a plain loop over keys: each key's record decayed, its sums added and its
    children merged in hash order (``BLPOMemory.with_effects`` as it was before it ran on columns)."""
    records = dict(records)
    for key, (w, s, q, contexts) in effects.items():
        added = dict(sorted(zip(context_hashes(list(contexts)), contexts.values())))
        old = records.get(key)
        if old is None:
            records[key] = MomentRecord(w, s, q, w, update, added)
            continue
        base = old.decayed(update, decay)
        for child in base.children.keys() & added.keys():
            added[child] += base.children[child]
        merged = {**base.children, **added}
        if len(merged) > len(base.children):  # new contexts: keep children sorted by hash
            merged = {c: merged[c] for c in sorted(merged)}
        records[key] = MomentRecord(base.W + w, base.S + s, base.Q + q, base.R + w, update, merged)
    return records


def run(rows: int, groups: int, keys: int) -> list[Figure]:
    """Time each estimator once and its reference once; figures: seconds and speed-up."""
    figures: list[Figure] = []
    warm = make_batch(rows, groups, keys, update_index=0, seed=1)
    batch = make_batch(rows, groups, keys, update_index=1)
    blpo = methods.ADVANTAGES.get("blpo")
    memory = blpo.fn(warm, BLPOParams(), None).state  # the earlier update's memory (untimed)
    records = dict(memory.items())  # the same memory as the reference's plain records (untimed)
    for name in LIMITS:
        entry = methods.ADVANTAGES.get(name)
        params = entry.params_cls()
        t0 = time.perf_counter()
        fast = entry.fn(batch, params, memory if name == "blpo" else None)
        fast_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if name == "gigpo":
            ref = loop_gigpo(batch, params)
        elif name == "blpo":
            ref, ref_records = loop_blpo(batch, params, records, memory.decay)
        else:
            ref = loop_trajectory(name, batch)
        slow_s = time.perf_counter() - t0
        np.testing.assert_allclose(fast.adv, ref, rtol=1e-9, atol=1e-9, err_msg=name)
        if name == "blpo":
            plain, written = BLPOMemory(memory.half_life, ref_records).records(), fast.state.records()
            assert [(r["role"], r["action"], r["n_children"]) for r in plain] == [
                (r["role"], r["action"], r["n_children"]) for r in written
            ], "BLPO reference wrote other keys or contexts"
            for f in "WSQR":
                np.testing.assert_allclose([r[f] for r in plain], [r[f] for r in written], rtol=1e-9, atol=1e-9)
        extra = f", memory {len(memory):,} keys" if name == "blpo" else ""
        figures += [
            Figure(
                f"advantage/{name}_s",
                fast_s,
                "s",
                f"< {LIMITS[name]}",
                fast_s < LIMITS[name],
                f"{len(batch):,} rows, {groups:,} groups{extra}",
            ),
            Figure(
                f"advantage/{name}_speedup",
                slow_s / fast_s,
                "x",
                ">= 20",
                slow_s / fast_s >= 20,
                f"plain loop {slow_s:.2f} s",
            ),
        ]
    return figures
