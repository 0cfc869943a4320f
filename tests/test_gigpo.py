"""GiGPO (methods/gigpo.py; docs/algorithms.md §4.3, §0.4, §7.1, §7.4).

A hand-computed batch in both modes (arithmetic in comments), the size-1 rules, a plain-loop reference
(per-group Python, as verl-agent writes it) against the vectorized code on random batches, and the
shared step helpers. Tolerance 1e-12 absolute unless stated; size-1 episode groups use the
documented relative 1e-5 (7.1).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import numpy as np
import pytest

from methods import stepwise
from methods.gigpo import GiGPOParams, gigpo_advantage
from methods.registry import ADVANTAGES
from methods.stepwise import (
    discounted_returns,
    factorize,
    group_moments,
    hashed_codes,
    pair_codes,
    trajectory_starts,
)
from methods.types import StepBatch

ATOL = 1e-12
EPS = 1e-6


def step_batch(rows, update_index: int = 0) -> StepBatch:
    """rows: (group_id, traj_id, reward, episode_return, anchor_obs, valid); turns counted per trajectory."""
    group_id, traj_id, reward, episode_return, obs, valid = (list(c) for c in zip(*rows))
    turn, seen = [], defaultdict(int)
    for t in traj_id:
        turn.append(seen[t])
        seen[t] += 1
    n_rows = len(rows)
    return StepBatch(
        group_id=np.asarray(group_id, dtype=np.int64),
        traj_id=np.asarray(traj_id, dtype=np.int64),
        turn=np.asarray(turn, dtype=np.int64),
        reward=np.asarray(reward, dtype=np.float64),
        episode_return=np.asarray(episode_return, dtype=np.float64),
        n_tokens=np.ones(n_rows, dtype=np.int64),
        update_index=update_index,
        anchor_obs=np.asarray(obs, dtype=object),
        valid=np.asarray(valid, dtype=bool),
    )


# uid 0: trajectory 1 succeeds at its third step; trajectory 2 fails and its second action is invalid.
# Both start from the observation "s0"; every other observation is seen once.
HAND_ROWS = [
    (0, 1, 0.0, 1.0, "s0", True),
    (0, 1, 0.0, 1.0, "s1", True),
    (0, 1, 1.0, 1.0, "s2", True),
    (0, 2, 0.0, 0.0, "s0", True),
    (0, 2, 0.0, 0.0, "s3", False),
    (0, 2, 0.0, 0.0, "s4", True),
]


def test_hand_computed_mean_std_norm():
    result = gigpo_advantage(step_batch(HAND_ROWS), GiGPOParams(mode="mean_std_norm"))
    # Scores (penalty 0.1 on the invalid row): [1, 1, 1, 0, -0.1, 0]; mean = 2.9 / 6.
    scores = [1.0, 1.0, 1.0, 0.0, -0.1, 0.0]
    mu = 2.9 / 6
    sigma = math.sqrt(sum((s - mu) ** 2 for s in scores) / 5)  # unbiased: 1.608333 / 5 -> 0.567157
    adv_episode = [(s - mu) / (sigma + EPS) for s in scores]  # 0.910976 (x3), -0.852207, -1.028531, -0.852207
    # Returns: traj 1 r = [0, 0, 1] -> G = [0.95^2, 0.95, 1] = [0.9025, 0.95, 1];
    #          traj 2 r' = [0, -0.1, 0] -> G = [0.95 * -0.1, -0.1, 0] = [-0.095, -0.1, 0].
    # Anchor "s0" holds G = 0.9025 and -0.095: mean 0.40375, std = 0.9975 / sqrt(2) = 0.705339;
    # A^S = +-0.49875 / (0.705339 + 1e-6) = +-0.707106. Every other anchor group has size 1 -> 0.
    std_s0 = 0.9975 / math.sqrt(2)
    adv_step = [0.49875 / (std_s0 + EPS), 0, 0, -0.49875 / (std_s0 + EPS), 0, 0]
    expected = np.add(adv_episode, adv_step)
    np.testing.assert_allclose(result.adv, expected, rtol=0, atol=ATOL)
    assert result.adv[0] == pytest.approx(0.910976 + 0.707106, abs=1e-6)
    assert result.keep.all() and result.state is None
    assert result.stats["anchor_groups"] == 5.0
    assert result.stats["anchor_grouped_fraction"] == pytest.approx(2 / 6, abs=ATOL)
    assert result.stats["mean_abs_adv_step"] == pytest.approx(2 * adv_step[0] / 6, abs=ATOL)


def test_hand_computed_mean_norm():
    result = gigpo_advantage(step_batch(HAND_ROWS), GiGPOParams(mode="mean_norm"))
    # A^E = score - 2.9/6; A^S on "s0" = G - 0.40375 = +0.49875 / -0.49875.
    mu = 2.9 / 6
    expected = [1 - mu + 0.49875, 1 - mu, 1 - mu, -mu - 0.49875, -0.1 - mu, -mu]
    np.testing.assert_allclose(result.adv, expected, rtol=0, atol=ATOL)


def test_per_trajectory_statistics():
    """cross_steps=False: mu, sigma over each trajectory's first-row score; rows keep their own score (7.4)."""
    result = gigpo_advantage(step_batch(HAND_ROWS), GiGPOParams(cross_steps=False, step_advantage_w=0.0))
    # Trajectory scores 1 and 0: mean 0.5, std = 1/sqrt(2). The invalid row's score is -0.1.
    sigma = 1 / math.sqrt(2)
    expected = [0.5 / (sigma + EPS)] * 3 + [-0.5 / (sigma + EPS), -0.6 / (sigma + EPS), -0.5 / (sigma + EPS)]
    np.testing.assert_allclose(result.adv, expected, rtol=0, atol=ATOL)


def test_size_one_groups():
    # uid 5 holds one single-step trajectory: A^E = 2 / (1 + 1e-6) (mean 0, std 1), A^S = 0 (size-1 anchor).
    result = gigpo_advantage(step_batch([(5, 9, 2.0, 2.0, "x", True)]), GiGPOParams())
    np.testing.assert_allclose(result.adv, [2.0], rtol=1e-5)
    assert result.adv[0] == 2.0 / (1 + EPS)
    result = gigpo_advantage(step_batch([(5, 9, 2.0, 2.0, "x", True)]), GiGPOParams(mode="mean_norm"))
    assert result.adv[0] == 2.0


def test_tied_groups_give_exact_zeros():
    # Both trajectories earn 0.1 at each of two steps from the same observations: all terms exactly 0 (7.2).
    rows = [(3, t, 0.1, 0.2, f"o{i}", True) for t in (1, 2) for i in range(2)]
    result = gigpo_advantage(step_batch(rows), GiGPOParams())
    assert np.all(result.adv == 0.0)


def test_registered_and_validates():
    entry = ADVANTAGES.get("gigpo")
    assert entry.fn is gigpo_advantage and entry.params_cls is GiGPOParams
    with pytest.raises(ValueError, match="mode"):
        GiGPOParams(mode="std")
    batch = step_batch(HAND_ROWS)
    bad = StepBatch(**{**batch.__dict__, "reward": np.array([0, np.nan, 0, 0, 0, 0.0])})
    with pytest.raises(ValueError, match="reward"):
        gigpo_advantage(bad, GiGPOParams())
    with pytest.raises(ValueError, match="anchor_obs"):
        gigpo_advantage(StepBatch(**{**batch.__dict__, "anchor_obs": None}), GiGPOParams())
    shuffled = StepBatch(**{**batch.__dict__, "traj_id": np.array([1, 2, 1, 2, 1, 2])})
    with pytest.raises(ValueError, match="contiguous"):
        gigpo_advantage(shuffled, GiGPOParams())


def loop_gigpo(rows, params: GiGPOParams) -> list[float]:
    """verl-agent's per-group loops (core_gigpo.episode_norm_reward, step_norm_reward), in float64."""
    penalty = [params.invalid_penalty * (not r[5]) for r in rows]
    scores = [r[3] - p for r, p in zip(rows, penalty)]
    returns, running, next_traj = [0.0] * len(rows), 0.0, None
    for n in range(len(rows) - 1, -1, -1):
        running = (rows[n][2] - penalty[n]) + params.gamma * (running if rows[n][1] == next_traj else 0.0)
        returns[n], next_traj = running, rows[n][1]

    def normalise(values, keys, stat_rows, singleton_raw):
        groups = defaultdict(list)
        for n in stat_rows:
            groups[keys[n]].append(values[n])
        out = []
        for n in range(len(rows)):
            members = groups[keys[n]]
            if len(members) == 1:
                mu, sd = (0.0, 1.0) if singleton_raw else (members[0], 1.0)
            else:
                mu, sd = statistics.fmean(members), statistics.stdev(members)
            out.append(values[n] - mu if params.mode == "mean_norm" else (values[n] - mu) / (sd + params.eps))
        return out

    uid = [r[0] for r in rows]
    if params.cross_steps:
        stat_rows = range(len(rows))
    else:
        stat_rows = [n for n in range(len(rows)) if n == 0 or rows[n][1] != rows[n - 1][1]]
    adv_episode = normalise(scores, uid, stat_rows, singleton_raw=True)
    anchor = [(r[0], r[4]) for r in rows]
    adv_step = normalise(returns, anchor, range(len(rows)), singleton_raw=False)
    return [e + params.step_advantage_w * s for e, s in zip(adv_episode, adv_step)]


def random_rows(seed: int, groups: int = 12, shared: bool = True, again: bool = False) -> list[tuple]:
    """Groups of 1-6 trajectories of 1-5 steps, rewards from a small set (ties), observations shared
    across groups (or each group's own with ``shared=False``); ``again``: the first group comes back
    at the end, so its rows are not one run."""
    rng = np.random.default_rng(seed)
    rows, traj = [], 0
    order = rng.permutation(groups)
    for uid in [*order, order[0]] if again else order:
        for _ in range(int(rng.integers(1, 7))):
            length, ret = int(rng.integers(1, 6)), float(rng.choice([0.0, 1.0, 0.5]))
            for t in range(length):
                reward = ret if t == length - 1 else float(rng.choice([0.0, 0.0, 0.1]))
                obs = (
                    (f"obs{rng.integers(0, 4)}" if shared else f"{uid}/obs{rng.integers(0, 4)}")
                    if t < 3
                    else f"deep{traj}"
                )
                rows.append((int(uid), traj, reward, ret, obs, bool(rng.random() > 0.2)))
            traj += 1
    return rows


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("cross_steps", [True, False])
def test_vectorized_equals_loop(seed, mode, cross_steps):
    rows = random_rows(seed)
    params = GiGPOParams(mode=mode, cross_steps=cross_steps, step_advantage_w=0.7)
    result = gigpo_advantage(step_batch(rows), params)
    np.testing.assert_allclose(result.adv, loop_gigpo(rows, params), rtol=0, atol=1e-10)
    assert result.adv.dtype == np.float64 and result.adv.shape == (len(rows),)


@pytest.mark.parametrize(("shared", "again"), [(True, False), (False, False), (True, True)])
def test_blocked_codes_equal_loop(shared, again, monkeypatch):
    """Past 4 * BLOCK_ROWS rows (64 here, so the batch stays small) the anchor observations are coded
    block by block (groups in one run each) or by one table (a group in two runs), and paired by
    their own codes when each names one uid."""
    monkeypatch.setattr(stepwise, "BLOCK_ROWS", 64)
    rows = random_rows(5, groups=120, shared=shared, again=again)
    assert len(rows) > 4 * 64
    params = GiGPOParams(step_advantage_w=0.7)
    result = gigpo_advantage(step_batch(rows), params)
    np.testing.assert_allclose(result.adv, loop_gigpo(rows, params), rtol=0, atol=1e-10)


def test_code_helpers_match_their_references():
    values = np.array([3, 3, 1, 1, 2, 2, 3])  # runs, one value coming back
    codes, uniques = factorize(values)
    assert codes.tolist() == [2, 2, 0, 0, 1, 1, 2] and uniques == [1, 2, 3]
    assert hashed_codes(values)[0].tolist() == [0, 0, 1, 1, 2, 2, 0]
    # packed range above 4N: b determines a (unused b code 1 renumbered away), then it does not
    assert [
        c.tolist() if isinstance(c, np.ndarray) else c for c in pair_codes(np.array([5, 5, 7]), np.array([0, 0, 2]), 3)
    ] == [[0, 0, 1], 2]
    assert [
        c.tolist() if isinstance(c, np.ndarray) else c for c in pair_codes(np.array([5, 6, 7]), np.array([0, 0, 2]), 3)
    ] == [[0, 1, 2], 3]


def test_discounted_returns_match_recursion_bit_for_bit():
    rows = random_rows(11)
    batch = step_batch(rows)
    returns = discounted_returns(batch.reward, trajectory_starts(batch), 0.95)
    running, next_traj, expected = 0.0, None, [0.0] * len(rows)
    for n in range(len(rows) - 1, -1, -1):
        running = rows[n][2] + 0.95 * (running if rows[n][1] == next_traj else 0.0)
        expected[n], next_traj = running, rows[n][1]
    assert returns.tolist() == expected


def test_group_moments_exact_for_ties():
    x = np.array([0.1, 0.1, 0.1, 0.7, 0.2])
    count, mean, var = group_moments(x, np.array([0, 0, 0, 1, 1]), 2)
    assert count.tolist() == [3, 2] and mean[0] == 0.1 and var[0] == 0.0
    assert mean[1] == pytest.approx(0.45, abs=ATOL) and var[1] == pytest.approx(0.125, abs=ATOL)
