"""Trajectory-level advantage estimators (methods/advantages.py; docs/algorithms.md §1.3–1.4, §4, §7).

Exact vectors with arithmetic in comments, a per-group Python loop reference compared with the
vectorized code on random batches, and invariance checks. Tolerance 1e-12 absolute unless stated; the
GRPO size-1 case allows the documented relative 1e-5 (§7.1).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import FrozenInstanceError

import numpy as np
import pytest

from methods.advantages import DrGRPOParams, GRPOParams, LOOParams, ReinforcePPBaselineParams, RLOOParams
from methods.registry import ADVANTAGES
from methods.types import StepBatch

OWN_ESTIMATORS = ("loo", "grpo", "drgrpo", "rloo", "reinforce_pp_baseline")
GROUP_LOCAL = ("loo", "grpo", "drgrpo", "rloo")  # reinforce_pp_baseline whitens over the whole batch
ATOL = 1e-12


def _batch(group_id, traj_id, episode_return, n_tokens=None, reward=None) -> StepBatch:
    """A StepBatch from row columns (N,); turn counts rows inside each trajectory."""
    traj_id = np.asarray(traj_id, dtype=np.int64)
    turn = np.zeros(len(traj_id), dtype=np.int64)
    seen: dict[int, int] = defaultdict(int)
    for n, t in enumerate(traj_id):
        turn[n] = seen[int(t)]
        seen[int(t)] += 1
    n_rows = len(traj_id)
    return StepBatch(
        group_id=np.asarray(group_id, dtype=np.int64),
        traj_id=traj_id,
        turn=turn,
        reward=np.zeros(n_rows) if reward is None else np.asarray(reward, dtype=np.float64),
        episode_return=np.asarray(episode_return, dtype=np.float64),
        n_tokens=np.ones(n_rows, dtype=np.int64) if n_tokens is None else np.asarray(n_tokens, dtype=np.int64),
    )


def _one_group(returns) -> StepBatch:
    """One row per trajectory, all in group 7."""
    n = len(returns)
    return _batch(np.full(n, 7), np.arange(n), returns)


def _run(name: str, batch: StepBatch, **overrides):
    entry = ADVANTAGES.get(name)
    return entry.fn(batch, entry.params_cls(**overrides), None)


def _random_batch(seed: int) -> StepBatch:
    """Groups of sizes 1..8 (each at least once), ties, all-equal groups, 1-4 rows per trajectory."""
    rng = np.random.default_rng(seed)
    sizes = list(range(1, 9)) + list(rng.integers(1, 9, size=12))
    trajs = []  # (group id, return, rows, tokens per row)
    for g, size in enumerate(sizes):
        kind = g % 4
        if kind == 0:
            returns = rng.uniform(-1.0, 2.0, size)
        elif kind == 1:
            returns = rng.choice([0.0, 0.5, 1.0], size)  # ties
        elif kind == 2:
            returns = np.full(size, [0.1, 1 / 3, 0.7][g % 3])  # all equal
        else:
            returns = rng.choice([0.0, 1.0], size)
        group = int(rng.integers(10**6)) * 10 + g  # sparse, unsorted ids
        trajs += [(group, float(r), int(rng.integers(1, 5))) for r in returns]
    order = rng.permutation(len(trajs))  # interleave groups; rows of a trajectory stay contiguous
    traj_ids = rng.permutation(10**6)[: len(trajs)]
    cols = defaultdict(list)
    for j in order:
        group, ret, rows = trajs[j]
        cols["group_id"] += [group] * rows
        cols["traj_id"] += [traj_ids[j]] * rows
        cols["episode_return"] += [ret] * rows
        cols["n_tokens"] += list(rng.integers(0, 20, rows))
    return _batch(cols["group_id"], cols["traj_id"], cols["episode_return"], cols["n_tokens"])


def _loop_reference(name: str, batch: StepBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain per-group loop with default params: (adv (N,), keep (N,), singleton (N,) bool)."""
    traj_return, traj_group, members = {}, {}, defaultdict(list)
    for n in range(len(batch)):
        t = int(batch.traj_id[n])
        if t not in traj_return:
            traj_return[t], traj_group[t] = float(batch.episode_return[n]), int(batch.group_id[n])
            members[traj_group[t]].append(t)
    adv, keep = {}, {}
    for trajs in members.values():
        returns = [traj_return[t] for t in trajs]
        size, mean = len(returns), sum(returns) / len(returns)
        if max(returns) == min(returns):  # §7.2: a tied group's mean is its value, so A is exactly 0
            mean = returns[0]
        for k, t in enumerate(trajs):
            others = [r for i, r in enumerate(returns) if i != k]
            loo_mean = sum(others) / len(others) if others else 0.0
            loo_mean = mean if max(returns) == min(returns) else loo_mean
            if name == "loo":
                adv[t] = returns[k] - loo_mean if size > 1 else 0.0
                keep[t] = size > 1 and abs(adv[t]) >= 0.01
                continue
            if name == "grpo" and size > 1:
                std = math.sqrt(sum((r - mean) ** 2 for r in returns) / (size - 1))
                adv[t] = (returns[k] - mean) / (std + 1e-6)
            elif name == "rloo" and size > 1:
                adv[t] = returns[k] - loo_mean
            elif name in ("drgrpo", "reinforce_pp_baseline") and size > 1:
                adv[t] = returns[k] - mean
            else:
                adv[t] = returns[k]  # size-1 group: raw score
            keep[t] = True
    rows = [int(t) for t in batch.traj_id]
    row_adv = np.array([adv[t] for t in rows])
    if name == "reinforce_pp_baseline":
        w = [float(x) for x in batch.n_tokens]
        mu = sum(wi * a for wi, a in zip(w, row_adv)) / sum(w)
        var = sum(wi * (a - mu) ** 2 for wi, a in zip(w, row_adv)) / (sum(w) - 1)
        row_adv = np.array([(a - mu) / math.sqrt(var + 1e-8) for a in row_adv])
    singleton = np.array([len(members[traj_group[t]]) == 1 for t in rows])
    return row_adv, np.array([keep[t] for t in rows]), singleton


def test_registry_holds_every_estimator_with_frozen_default_params():
    for name in OWN_ESTIMATORS:
        params = ADVANTAGES.get(name).params_cls()
        with pytest.raises(FrozenInstanceError):
            params.abs_adv_threshold = 1.0


def test_loop_vector():
    # §1.3: K = 6, sum R = 3; A_k = R_k − (3 − R_k)/5
    # R=1: 1 − 2/5 = 0.6;  R=0: 0 − 3/5 = −0.6;  R=0.5: 0.5 − 2.5/5 = 0
    res = _run("loo", _one_group([1, 0, 0, 1, 0.5, 0.5]))
    np.testing.assert_allclose(res.adv, [0.6, -0.6, -0.6, 0.6, 0.0, 0.0], rtol=0, atol=ATOL)
    assert res.adv[4] == 0.0 and res.adv[5] == 0.0
    np.testing.assert_array_equal(res.keep, [True, True, True, True, False, False])  # |A| ≥ 0.01
    assert res.stats["kept_fraction"] == pytest.approx(4 / 6, abs=ATOL)
    assert res.stats["groups"] == 1.0 and res.stats["zero_group_fraction"] == 0.0


def test_loop_variants():
    batch = _one_group([1, 0, 0, 1, 0.5, 0.5])  # mean 0.5, deviations [.5, −.5, −.5, .5, 0, 0]
    none_out = _run("loo", batch, baseline="leave_none_out")
    np.testing.assert_allclose(none_out.adv, [0.5, -0.5, -0.5, 0.5, 0, 0], rtol=0, atol=ATOL)
    # population std = sqrt((4·0.25)/6) = sqrt(1/6) = 0.408248...; 0.6 / 0.408248 = 1.469693845669907
    normed = _run("loo", batch, normalize_std=True)
    np.testing.assert_allclose(normed.adv, [1.469693845669907 * s for s in (1, -1, -1, 1, 0, 0)], atol=1e-12)
    # kl_lambda 0.1 is added: [0.7, −0.5, −0.5, 0.7, 0.1, 0.1], all |A| ≥ 0.01
    shifted = _run("loo", batch, kl_lambda=0.1)
    np.testing.assert_allclose(shifted.adv, [0.7, -0.5, -0.5, 0.7, 0.1, 0.1], rtol=0, atol=ATOL)
    assert shifted.keep.all()
    np.testing.assert_array_equal(_run("loo", batch, pos_adv_only=True).keep, [1, 0, 0, 1, 0, 0])


def test_loop_size_one_group_is_dropped():
    # §6.8 default: a size-1 group gets A = 0 and keep = False, even with kl_lambda > 0
    batch = _batch([1, 1, 2], [10, 11, 12], [1.0, 0.0, 5.0])
    res = _run("loo", batch, kl_lambda=0.2)
    np.testing.assert_allclose(res.adv, [1.2, -0.8, 0.0], rtol=0, atol=ATOL)  # 1 − 0 + 0.2; 0 − 1 + 0.2
    np.testing.assert_array_equal(res.keep, [True, True, False])


@pytest.mark.parametrize("bad", [{"kl_lambda": -0.1}, {"baseline": "leave_two_out"}])
def test_loop_params_are_validated(bad):
    with pytest.raises(ValueError):
        LOOParams(**bad)


def test_grpo_vector():
    # mean 0.5, deviations [.5, −.5, −.5, .5, 0, 0], Σdev² = 1, unbiased std = sqrt(1/5) = 0.4472135954999579
    # A = ±0.5 / (0.4472135954999579 + 1e-6) = ±1.1180314884856...
    a = 0.5 / (math.sqrt(0.2) + 1e-6)
    res = _run("grpo", _one_group([1, 0, 0, 1, 0.5, 0.5]))
    np.testing.assert_allclose(res.adv, [a, -a, -a, a, 0, 0], rtol=0, atol=ATOL)
    assert res.adv[0] == pytest.approx(1.1180314885, abs=1e-9)
    assert res.keep.all()


def test_rloo_drgrpo_grpo_vectors_with_size_one_group():
    # group 1: R = [1, 2, 4], mean 7/3; group 2: R = [3] (size 1)
    batch = _batch([1, 1, 1, 2], [0, 1, 2, 3], [1.0, 2.0, 4.0, 3.0])
    # RLOO: 1 − (2+4)/2 = −2; 2 − (1+4)/2 = −0.5; 4 − (1+2)/2 = 2.5; size 1 → R = 3
    np.testing.assert_allclose(_run("rloo", batch).adv, [-2.0, -0.5, 2.5, 3.0], rtol=0, atol=ATOL)
    # Dr.GRPO: R − 7/3 = [−4/3, −1/3, 5/3]; size 1 → R = 3
    np.testing.assert_allclose(_run("drgrpo", batch).adv, [-4 / 3, -1 / 3, 5 / 3, 3.0], rtol=0, atol=ATOL)
    # GRPO: Σdev² = (16 + 1 + 25)/9 = 14/3, unbiased var = 7/3, std = 1.5275252316519468
    # size 1 → mean 0, std 1: 3 / (1 + 1e-6)
    std = math.sqrt(7 / 3)
    expected = [d / (std + 1e-6) for d in (-4 / 3, -1 / 3, 5 / 3)] + [3 / (1 + 1e-6)]
    np.testing.assert_allclose(_run("grpo", batch).adv, expected, rtol=0, atol=ATOL)
    np.testing.assert_allclose(_run("grpo", batch, norm_by_std=False).adv, _run("drgrpo", batch).adv, atol=0)


def test_reinforce_pp_baseline_vector():
    # a = R − mean_g: group 1 R = [1, 0] → [0.5, −0.5]; group 2 R = [2] size 1 → mean 0 → 2
    # token weights [1, 3, 2], W = 6: μ = (0.5 − 1.5 + 4)/6 = 0.5; centered [0, −1, 1.5]
    # unbiased var = (0 + 3·1 + 2·2.25)/5 = 1.5; A = centered / sqrt(1.5 + 1e-8)
    batch = _batch([1, 1, 2], [0, 1, 2], [1.0, 0.0, 2.0], n_tokens=[1, 3, 2])
    expected = np.array([0.0, -1.0, 1.5]) / math.sqrt(1.5 + 1e-8)
    np.testing.assert_allclose(_run("reinforce_pp_baseline", batch).adv, expected, rtol=0, atol=ATOL)
    # one policy token in the batch: no unbiased variance, so no signal (A = 0, not an error)
    np.testing.assert_array_equal(
        _run("reinforce_pp_baseline", _batch([1, 1], [0, 1], [1.0, 0.0], n_tokens=[1, 0])).adv, 0.0
    )


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("name", OWN_ESTIMATORS)
def test_vectorized_equals_loop(name, seed):
    batch = _random_batch(seed)
    res = _run(name, batch)
    adv, keep, singleton = _loop_reference(name, batch)
    assert res.adv.shape == (len(batch),) and res.keep.shape == (len(batch),)
    assert res.adv.dtype == np.float64 and res.keep.dtype == np.bool_
    if name == "grpo":  # §7.1: size-1 GRPO is R/(1 + 1e-6), the loop says "raw score" R
        np.testing.assert_allclose(res.adv[singleton], adv[singleton], rtol=1e-5, atol=0)
        np.testing.assert_allclose(res.adv[~singleton], adv[~singleton], rtol=0, atol=ATOL)
    else:
        np.testing.assert_allclose(res.adv, adv, rtol=0, atol=ATOL)
    np.testing.assert_array_equal(res.keep, keep)


@pytest.mark.parametrize("name", GROUP_LOCAL)
def test_all_equal_groups_give_exact_zero(name):
    # §0.4 / §7.2: identical returns give exactly 0, including values whose mean rounds (0.1, 1/3, 0.7)
    values = [0.1] * 7 + [1 / 3] * 3 + [0.7] * 5 + [1.0, 0.0]
    groups = [1] * 7 + [2] * 3 + [3] * 5 + [4, 4]
    res = _run(name, _batch(groups, range(len(values)), values))
    assert np.all(res.adv[:15] == 0.0)
    assert res.stats["zero_group_fraction"] == 0.75  # 3 of 4 groups


@pytest.mark.parametrize("name", GROUP_LOCAL)
def test_other_groups_do_not_change_a_group(name):
    batch = _random_batch(11)
    target = batch.group_id == batch.group_id[0]
    rng = np.random.default_rng(3)
    changed = np.where(target, batch.episode_return, 0.0)
    for t in np.unique(batch.traj_id[~target]):  # new return per other trajectory, same on its rows
        changed[batch.traj_id == t] = rng.normal()
    other = _batch(batch.group_id, batch.traj_id, changed, batch.n_tokens)
    np.testing.assert_array_equal(_run(name, other).adv[target], _run(name, batch).adv[target])


@pytest.mark.parametrize("name", OWN_ESTIMATORS)
def test_permuting_rows_permutes_results(name):
    batch = _random_batch(5)
    perm = np.random.default_rng(0).permutation(len(batch))
    permuted = _batch(batch.group_id[perm], batch.traj_id[perm], batch.episode_return[perm], batch.n_tokens[perm])
    res, res_perm = _run(name, batch), _run(name, permuted)
    np.testing.assert_allclose(res_perm.adv, res.adv[perm], rtol=0, atol=ATOL)
    np.testing.assert_array_equal(res_perm.keep, res.keep[perm])


@pytest.mark.parametrize("name", OWN_ESTIMATORS)
def test_rows_of_one_trajectory_share_one_value(name):
    batch = _random_batch(2)
    res = _run(name, batch)
    for t in np.unique(batch.traj_id):
        rows = batch.traj_id == t
        assert np.all(res.adv[rows] == res.adv[rows][0]) and np.all(res.keep[rows] == res.keep[rows][0])


@pytest.mark.parametrize("name", OWN_ESTIMATORS)
def test_per_step_reward_is_ignored(name):
    batch = _random_batch(4)
    noisy = _batch(
        batch.group_id,
        batch.traj_id,
        batch.episode_return,
        batch.n_tokens,
        reward=np.random.default_rng(1).normal(size=len(batch)) * 100,
    )
    np.testing.assert_array_equal(_run(name, noisy).adv, _run(name, batch).adv)


@pytest.mark.parametrize("name", OWN_ESTIMATORS)
def test_rows_of_one_trajectory_must_agree(name):
    with pytest.raises(ValueError, match="episode_return"):
        _run(name, _batch([1, 1, 1], [0, 0, 1], [1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match="group_id"):
        _run(name, _batch([1, 2, 1], [0, 0, 1], [1.0, 1.0, 0.0]))


def test_params_classes_are_exported():
    assert ADVANTAGES.get("loo").params_cls is LOOParams
    assert ADVANTAGES.get("grpo").params_cls is GRPOParams
    assert ADVANTAGES.get("drgrpo").params_cls is DrGRPOParams
    assert ADVANTAGES.get("rloo").params_cls is RLOOParams
    assert ADVANTAGES.get("reinforce_pp_baseline").params_cls is ReinforcePPBaselineParams
