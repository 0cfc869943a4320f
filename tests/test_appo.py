"""APPO: branching score, selection, dual-group advantage, M and the future-KL loss (docs/algorithms.md §3)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from methods.aggregation import LossTerms
from methods.appo import (
    APPOParams,
    BranchingParams,
    BranchingScore,
    appo_advantage,
    branching_score,
    entropy_zscore,
    future_value,
    reward_scale_M,
    select_branch_points,
    zscore,
)
from methods.appo_loss import (
    FutureKLParams,
    appo_future_kl_loss,
    discounted_suffix_sum,
    future_kl,
    influence_factor,
)
from methods.registry import ADVANTAGES, LOSSES
from methods.types import StepBatch

# ----------------------------------------------------------------------------------------------------------
# Dual-group advantage (§3.5)


def make_batch(trajs: list[dict], turn_tokens: dict[int, list[int]] | None = None) -> StepBatch:
    """One StepBatch from trajectory records {id, group, kind, R, parent, split, tokens[, score]}.

    ``turn_tokens[id]`` splits a trajectory's tokens over several turns (rows); default one row.
    """
    cols: dict[str, list] = {
        k: [] for k in ("group_id", "traj_id", "turn", "reward", "ret", "n", "kind", "parent", "split", "score")
    }
    for tr in trajs:
        per_turn = (turn_tokens or {}).get(tr["id"], [tr["tokens"]])
        assert sum(per_turn) == tr["tokens"]
        for turn, n in enumerate(per_turn):
            last = turn == len(per_turn) - 1
            for key, value in (
                ("group_id", tr["group"]),
                ("traj_id", tr["id"]),
                ("turn", turn),
                ("reward", tr["R"] if last else 0.0),
                ("ret", tr["R"]),
                ("n", n),
                ("kind", tr["kind"]),
                ("parent", tr.get("parent", -1)),
                ("split", tr.get("split", -1)),
                ("score", tr.get("score", 0.0)),
            ):
                cols[key].append(value)
    return StepBatch(
        group_id=np.array(cols["group_id"], np.int64),
        traj_id=np.array(cols["traj_id"], np.int64),
        turn=np.array(cols["turn"], np.int64),
        reward=np.array(cols["reward"], np.float64),
        episode_return=np.array(cols["ret"], np.float64),
        n_tokens=np.array(cols["n"], np.int64),
        kind=np.array(cols["kind"], np.int8),
        parent_traj=np.array(cols["parent"], np.int64),
        branch_token=np.array(cols["split"], np.int64),
        extras={"branch_score": np.array(cols["score"], np.float64)},
    )


def spec_trajs(init_R=(1.0, 0.0, 0.0, 0.0), branch_R=(1.0, 1.0, 0.0, 0.0)) -> list[dict]:
    """§3.5 vector: 4 initial rollouts of 8 tokens; branches 0, 1 from init 1 (s = 5, 2), 2, 3 from init 2 (s = 4).

    Branches have 6 tokens each (their own tokens never enter the loss).
    """
    inits = [dict(id=i, group=0, kind=0, R=r, tokens=8) for i, r in enumerate(init_R)]
    parents, splits = (1, 1, 2, 2), (5, 2, 4, 4)
    branches = [
        dict(id=4 + b, group=0, kind=1, R=r, parent=parents[b], split=splits[b], tokens=6)
        for b, r in enumerate(branch_R)
    ]
    return inits + branches


SPEC_TOKENS = np.concatenate(
    [
        [1.732] * 8,
        [0.423] * 6 + [-0.577] * 2,  # tokens 0–2: −0.577 + mean(1, 1); 3–5: −0.577 + 1; 6–7: no branch
        [-1.577] * 5 + [-0.577] * 3,  # tokens 0–4: −0.577 + mean(−1, −1)
        [-0.577] * 8,
        [0.0] * 24,  # branch rows
    ]
)


def test_spec_vector_one_row_per_trajectory():
    res = appo_advantage(make_batch(spec_trajs()), APPOParams(), None)
    assert res.adv_tokens.shape == (56,) and res.adv.shape == (8,) and res.keep.shape == (8,)
    np.testing.assert_allclose(res.adv_tokens, SPEC_TOKENS, atol=1e-3)
    np.testing.assert_array_equal(res.keep, [True] * 4 + [False] * 4)
    np.testing.assert_allclose(
        res.adv[:4], [1.732, (6 * 0.423 - 2 * 0.577) / 8, (-5 * 1.577 - 3 * 0.577) / 8, -0.577], atol=1e-3
    )
    np.testing.assert_array_equal(res.adv[4:], 0.0)
    assert res.state is None
    assert res.stats == pytest.approx(
        {"branches": 4.0, "groups": 1.0, "branch_credit_fraction": 11 / 32, "zero_group_fraction": 0.0}
    )


def test_spec_vector_two_turns_same_flat_tokens():
    """The same tokens over two turns (3 + 5): splits 4 and 5 fall in the second turn."""
    trajs = spec_trajs()
    res = appo_advantage(make_batch(trajs, {t["id"]: [3, 5] for t in trajs[:4]}), APPOParams(), None)
    np.testing.assert_allclose(res.adv_tokens, SPEC_TOKENS, atol=1e-3)
    assert res.adv.shape == (12,)
    # per-row means: init 1 turns [0.423 x3], [0.423 x3, -0.577 x2]; init 2 [-1.577 x3], [-1.577 x2, -0.577 x3]
    np.testing.assert_allclose(
        res.adv[2:6], [0.423, (3 * 0.423 - 2 * 0.577) / 5, -1.577, (-2 * 1.577 - 3 * 0.577) / 5], atol=1e-3
    )
    np.testing.assert_array_equal(res.keep, [True] * 8 + [False] * 4)


def test_exact_group_values():
    """Â_init = 0.75/(√0.1875 + 1e-6) etc.; population std, ε = 1e-6 (§0.4). Tolerance 1e-12."""
    res = appo_advantage(make_batch(spec_trajs()), APPOParams(), None)
    a_hi, a_lo, a_br = 0.75 / (math.sqrt(0.1875) + 1e-6), -0.25 / (math.sqrt(0.1875) + 1e-6), 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(res.adv_tokens[:8], a_hi, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res.adv_tokens[8:16], [a_lo + a_br] * 6 + [a_lo] * 2, rtol=0, atol=1e-12)


def test_identical_init_rewards_keep_branch_credit():
    """§3.11: Â_init = 0 exactly, branch credit still reaches the prefixes."""
    res = appo_advantage(make_batch(spec_trajs(init_R=(0.3, 0.3, 0.3, 0.3))), APPOParams(), None)
    a_br = 0.5 / (0.5 + 1e-6)
    np.testing.assert_array_equal(res.adv_tokens[:8], 0.0)
    np.testing.assert_array_equal(res.adv_tokens[24:32], 0.0)
    np.testing.assert_allclose(res.adv_tokens[8:16], [a_br] * 6 + [0.0] * 2, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res.adv_tokens[16:24], [-a_br] * 5 + [0.0] * 3, rtol=0, atol=1e-12)
    assert res.stats["zero_group_fraction"] == 0.0


def test_identical_branch_rewards_give_no_credit():
    res = appo_advantage(make_batch(spec_trajs(branch_R=(0.7, 0.7, 0.7, 0.7))), APPOParams(), None)
    inits_only = appo_advantage(make_batch(spec_trajs()[:4]), APPOParams(), None).adv_tokens
    np.testing.assert_array_equal(res.adv_tokens[:32], inits_only)


def test_group_of_size_one_gives_zero():
    """§3.11: one initial rollout and one branch: population std 0 → Â = 0, all tokens exactly 0."""
    trajs = [
        dict(id=0, group=3, kind=0, R=1.0, tokens=4),
        dict(id=1, group=3, kind=1, R=0.0, parent=0, split=2, tokens=3),
    ]
    res = appo_advantage(make_batch(trajs), APPOParams(), None)
    np.testing.assert_array_equal(res.adv_tokens, np.zeros(7))
    assert res.stats["zero_group_fraction"] == 1.0 and res.stats["branch_credit_fraction"] == 0.75


def test_norm_by_std_false_is_centred_return():
    res = appo_advantage(make_batch(spec_trajs()), APPOParams(norm_by_std=False), None)
    np.testing.assert_allclose(res.adv_tokens[:8], 0.75, atol=1e-12)
    np.testing.assert_allclose(res.adv_tokens[8:16], [-0.25 + 0.5] * 6 + [-0.25] * 2, atol=1e-12)


def test_two_groups_are_normalised_separately_and_order_invariant():
    """Invariance: reordering whole trajectories (§3.11 batch reordering) changes nothing per trajectory."""
    trajs = spec_trajs() + [
        dict(t, id=t["id"] + 10, group=1, R=2 * t["R"], parent=t.get("parent", -1) + 10 if t["kind"] else -1)
        for t in spec_trajs()
    ]
    res = appo_advantage(make_batch(trajs), APPOParams(), None)
    np.testing.assert_allclose(res.adv_tokens[:56], SPEC_TOKENS, atol=1e-3)
    np.testing.assert_allclose(res.adv_tokens[56:], SPEC_TOKENS, atol=1e-3)  # scale-free z-score
    order = [11, 5, 0, 14, 2, 15, 3, 10, 9, 1, 7, 13, 4, 12, 6, 8]
    shuffled = appo_advantage(make_batch([trajs[k] for k in order]), APPOParams(), None)
    starts = np.cumsum([0] + [t["tokens"] for t in trajs])
    expected = np.concatenate([res.adv_tokens[starts[k] : starts[k + 1]] for k in order])
    np.testing.assert_array_equal(shuffled.adv_tokens, expected)


@pytest.mark.parametrize("bad", ["missing_parent", "branch_parent", "split_too_far", "non_contiguous"])
def test_bad_lineage_raises(bad):
    trajs = spec_trajs()
    if bad == "missing_parent":
        trajs[4]["parent"] = 99
    elif bad == "branch_parent":
        trajs[4]["parent"] = 5
    elif bad == "split_too_far":
        trajs[4]["split"] = 8  # the parent has 8 tokens: valid splits are 0..7
    batch = make_batch(trajs, {0: [4, 4]})
    if bad == "non_contiguous":  # rows 0 and 2 belong to trajectory 0, row 1 to trajectory 1
        perm = np.array([0, 2, 1, *range(3, 9)])
        batch = StepBatch(**{k: v[perm] if isinstance(v, np.ndarray) else v for k, v in vars(batch).items()})
    with pytest.raises(ValueError):
        appo_advantage(batch, APPOParams(), None)


def test_missing_column_raises():
    batch = make_batch(spec_trajs())
    with pytest.raises(ValueError, match="kind"):
        appo_advantage(StepBatch(**{**vars(batch), "kind": None}), APPOParams(), None)


# ----------------------------------------------------------------------------------------------------------
# Reward scale factor M (§3.6)


def test_reward_scale_M_spec_vector():
    # t ≤ 3: 1 + 0.5·0.9^(3−t) = 1 + 0.5·[0.729, 0.81, 0.9, 1]
    np.testing.assert_allclose(reward_scale_M(3, 0.5, 7, 0.9), [1.3645, 1.405, 1.45, 1.5, 1, 1, 1], atol=1e-12)
    np.testing.assert_array_equal(reward_scale_M(3, 0.0, 5), np.ones(5))
    np.testing.assert_array_equal(reward_scale_M(3, -1.0, 5), np.ones(5))
    # s = 5 beyond a 3-token response: only t = 0..2 exist, 1 + 0.5^(5−t)
    np.testing.assert_allclose(reward_scale_M(5, 1.0, 3, 0.5), [1.03125, 1.0625, 1.125], atol=1e-12)


def test_reward_scale_M_is_a_no_op_when_splits_precede_the_last_token():
    trajs = [dict(t, score=1.0 + t["id"]) for t in spec_trajs()]
    plain = appo_advantage(make_batch(trajs), APPOParams(), None)
    scaled = appo_advantage(make_batch(trajs), APPOParams(reward_scale_M=True), None)
    np.testing.assert_array_equal(scaled.adv_tokens, plain.adv_tokens)


def test_reward_scale_M_at_the_last_token_scales_the_return():
    """A split at the parent's last token (M = 1 + 1·0.9^0 = 2 there) doubles R_A.

    R = [2, 1, 0] instead of [1, 1, 0].
    """
    trajs = [
        dict(id=0, group=0, kind=0, R=1.0, tokens=4),
        dict(id=1, group=0, kind=0, R=1.0, tokens=4),
        dict(id=2, group=0, kind=0, R=0.0, tokens=4),
        dict(id=3, group=0, kind=1, R=0.0, parent=0, split=3, tokens=2, score=2.0),
    ]
    scaled = appo_advantage(make_batch(trajs), APPOParams(reward_scale_M=True), None)
    z = 1.0 / (math.sqrt(2 / 3) + 1e-6)  # [2, 1, 0]: mean 1, population std √(2/3); the branch group has size 1
    np.testing.assert_allclose(scaled.adv_tokens[:12], [z] * 4 + [0.0] * 4 + [-z] * 4, atol=1e-12)
    plain = appo_advantage(make_batch(trajs), APPOParams(), None)
    np.testing.assert_allclose(plain.adv_tokens[0], (1 / 3) / (math.sqrt(2 / 9) + 1e-6), atol=1e-12)
    no_scores = make_batch(trajs)
    no_scores.extras.clear()  # no branch_score: M = 1
    np.testing.assert_array_equal(
        appo_advantage(no_scores, APPOParams(reward_scale_M=True), None).adv_tokens, plain.adv_tokens
    )


def test_scale_token_advantages_by_M():
    """§6.3 option: A_{i,t} *= mean_b M_b[t]; every branch has BS/max = 1."""
    trajs = [dict(t, score=1.0) for t in spec_trajs()]
    plain = appo_advantage(make_batch(trajs), APPOParams(), None).adv_tokens
    res = appo_advantage(make_batch(trajs), APPOParams(scale_token_advantages_by_M=True), None).adv_tokens
    m1 = (reward_scale_M(5, 1.0, 8) + reward_scale_M(2, 1.0, 8)) / 2  # init 1: splits 5 and 2
    m2 = reward_scale_M(4, 1.0, 8)  # init 2: two splits at 4
    np.testing.assert_allclose(
        m1[:3], [((1 + 0.9**5) + (1 + 0.9**2)) / 2, (2 + 0.9**4 + 0.9) / 2, (2 + 0.9**3 + 1) / 2], atol=1e-12
    )
    np.testing.assert_allclose(res, plain * np.concatenate([np.ones(8), m1, m2, np.ones(32)]), atol=1e-12)


def test_reward_scale_M_counts_observation_tokens_between_turns():
    """κ^{s_b − t} over response positions (§3.6 with §3.7's distances): init 0 has 3 action tokens, then
    4 observation tokens, then 2 more, so its response positions are [0, 1, 2, 7, 8]. A branch split at
    flat token 3 (position 7) with BS/max = 1, κ = 0.9: M = 1 + 0.9^(7 − pos) for t ≤ 3, so
    [1 + 0.9^7, 1 + 0.9^6, 1 + 0.9^5, 2, 1] = [1.4782969, 1.531441, 1.59049, 2, 1] (flat tokens would give
    1 + 0.9^3, 1 + 0.9^2, 1 + 0.9 for the first three)."""
    trajs = [
        dict(id=0, group=0, kind=0, R=1.0, tokens=5),
        dict(id=1, group=0, kind=0, R=0.0, tokens=4),
        dict(id=2, group=0, kind=1, R=1.0, parent=0, split=3, tokens=2, score=1.0),
        dict(id=3, group=0, kind=1, R=0.0, parent=1, split=0, tokens=2, score=1.0),
    ]
    batch = make_batch(trajs, turn_tokens={0: [3, 2], 1: [2, 2]})
    batch = dataclasses.replace(
        batch, gap_tokens=np.array([0, 4, 0, 6, 0, 0], np.int64)
    )  # rows: 0/0, 0/1, 1/0, 1/1, 2, 3
    plain = appo_advantage(batch, APPOParams(), None).adv_tokens
    scaled = appo_advantage(batch, APPOParams(scale_token_advantages_by_M=True), None).adv_tokens
    M0 = np.array([1 + 0.9**7, 1 + 0.9**6, 1 + 0.9**5, 2.0, 1.0])
    np.testing.assert_allclose(M0, [1.4782969, 1.531441, 1.59049, 2.0, 1.0], atol=1e-12)
    np.testing.assert_allclose(scaled[:5], plain[:5] * M0, atol=1e-12)
    np.testing.assert_allclose(reward_scale_M(3, 1.0, 5, 0.9, np.array([0, 1, 2, 7, 8])), M0, atol=1e-12)
    without_gaps = appo_advantage(
        dataclasses.replace(batch, gap_tokens=None), APPOParams(scale_token_advantages_by_M=True), None
    )
    np.testing.assert_allclose(without_gaps.adv_tokens[:5], plain[:5] * reward_scale_M(3, 1.0, 5, 0.9), atol=1e-12)


# ----------------------------------------------------------------------------------------------------------
# Branching score (§3.2)


def test_branching_score_hand_computed():
    entropy = np.array([0.0, 1.0, 2.0, 3.0])
    # Z(H): mean 1.5, population std √1.25 = 1.1180340 → ±1.5/1.118035, ±0.5/1.118035
    logp_roll = np.full(4, -1.0)
    logp_cur = np.array([-0.7, -0.9, -1.4, -0.9])  # Δ = [0.3, 0.1, −0.4, 0.1]
    # suffix sums (γ = 1): [0.1, −0.2, −0.3, 0.1]; exp: [1.105171, 0.818731, 0.740818, 1.105171]
    # clip to [0.8, 1.2]: Ω = [1.105171, 0.818731, 0.8, 1.105171]; mean 0.957268, population std 0.148051
    # Z(Ω) = [0.998992, −0.935735, −1.062250, 0.998992]; BS = Z(H)·Z(Ω)
    omega = future_value(logp_cur, logp_roll)
    np.testing.assert_allclose(omega, [1.1051709, 0.8187308, 0.8, 1.1051709], atol=1e-7)
    sc = branching_score(entropy, logp_cur, logp_roll, BranchingParams())
    np.testing.assert_allclose(sc.z_entropy, [-1.3416396, -0.4472132, 0.4472132, 1.3416396], atol=1e-6)
    np.testing.assert_allclose(sc.z_omega, [0.9989924, -0.9357350, -1.0622497, 0.9989924], atol=1e-6)
    np.testing.assert_allclose(sc.bs, [-1.3402877, 0.4184730, -0.4750521, 1.3402877], atol=1e-6)
    assert not sc.omega_fallback
    # only t = 3 is strict (t = 1 has BS > 0 but both z-scores negative)
    sel = select_branch_points([sc], [np.ones(4, bool)], budget=2)
    assert [(p.split, p.how) for p in sel.points] == [(3, "strict"), (1, "fallback")]
    assert sel.counts == {"strict": 1, "fallback": 1, "cyclic": 0, "dropped": 0}


def test_future_value_discount_matches_loop():
    rng = np.random.default_rng(0)
    delta = rng.normal(0, 0.05, 11)
    gamma = 0.9
    suffix = [sum(gamma ** (k - t) * delta[k] for k in range(t, 11)) for t in range(11)]
    expected = np.clip(np.exp(suffix), 0.8, 1.2)
    np.testing.assert_allclose(future_value(delta, np.zeros(11), gamma=gamma), expected, atol=1e-12)
    np.testing.assert_allclose(future_value(np.array([30.0]), np.zeros(1), eps_omega=0.0), [math.exp(20)])


def test_zscore_exact_zeros_for_constant_input():
    for value in (0.1, 1.2, 0.8, -3.7):
        assert np.all(zscore(np.full(13, value)) == 0.0)
    assert zscore(np.zeros(0)).shape == (0,)
    np.testing.assert_allclose(entropy_zscore(np.array([1.0, 3.0])), [-1 / (1 + 1e-6), 1 / (1 + 1e-6)])


def test_constant_omega_without_fallback_picks_earliest():
    """§3.11, code-faithful mode: Z(Ω) = 0 exactly, BS = 0, no strict points, earliest tokens of earliest rows."""
    params = BranchingParams(omega_fallback="none")
    entropy = [np.array([0.1, 0.9, 0.5]), np.array([2.0, 0.2, 0.3, 0.4])]
    scores = [branching_score(h, np.full(h.size, -0.5), np.full(h.size, -0.5), params) for h in entropy]
    for sc in scores:
        assert np.all(sc.z_omega == 0.0) and np.all(sc.bs == 0.0) and not sc.omega_fallback
    sel = select_branch_points(scores, [np.ones(3, bool), np.ones(4, bool)], budget=4)
    assert [(p.rollout, p.split, p.how) for p in sel.points] == [
        (0, 0, "fallback"),
        (0, 1, "fallback"),
        (0, 2, "fallback"),
        (1, 0, "fallback"),
    ]
    assert sel.counts["strict"] == 0


def test_constant_omega_clipped_to_bound_is_constant():
    """Ω clipped to 1.2 everywhere (every suffix sum ≥ log 1.2) still gives exact zeros."""
    logp_cur = np.array([-0.1, -0.2, -0.3, -0.1, -0.9])
    sc = branching_score(np.array([1.0, 0.3, 0.2, 0.7, 0.1]), logp_cur, logp_cur - 1.0, BranchingParams())
    assert np.all(sc.z_omega == 0.0) and sc.omega_fallback


def test_constant_omega_entropy_only_fallback():
    """§6.4 default: BS = Z(H) where Z(H) > 0, flagged; those positions are strict, ranked by Z(H)."""
    entropy = np.array([0.0, 1.0, 2.0, 3.0])
    sc = branching_score(entropy, np.zeros(4), np.zeros(4), BranchingParams())
    assert sc.omega_fallback
    np.testing.assert_allclose(sc.bs, [0.0, 0.0, 0.4472132, 1.3416396], atol=1e-6)
    sel = select_branch_points([sc], [np.ones(4, bool)], budget=3)
    assert [(p.split, p.how) for p in sel.points] == [(3, "strict"), (2, "strict"), (0, "fallback")]


# ----------------------------------------------------------------------------------------------------------
# Branch selection (§3.3)


def _score(bs, z_entropy=None, z_omega=None) -> BranchingScore:
    """A BranchingScore with given BS; z-scores default to +1 so that BS > 0 alone decides strictness."""
    bs = np.asarray(bs, np.float64)
    z_entropy = np.ones_like(bs) if z_entropy is None else np.asarray(z_entropy, np.float64)
    z_omega = np.ones_like(bs) if z_omega is None else np.asarray(z_omega, np.float64)
    return BranchingScore(bs, z_entropy, z_omega, False)


def test_strict_top_b_pooled_over_rollouts_then_fallback():
    scores = [_score([0.5, 2.0, -1.0]), _score([3.0, 0.1, 0.0], z_omega=[1.0, -1.0, 1.0])]
    cands = [np.ones(3, bool), np.ones(3, bool)]
    sel = select_branch_points(scores, cands, budget=2)
    assert [(p.rollout, p.split, p.score, p.how) for p in sel.points] == [(1, 0, 3.0, "strict"), (0, 1, 2.0, "strict")]
    sel = select_branch_points(scores, cands, budget=5)
    # strict: 3.0, 2.0, 0.5; fallback by BS: (1,1) 0.1 (Z(Ω) < 0), then (1,2) 0.0 (BS not > 0)
    assert [(p.rollout, p.split, p.how) for p in sel.points] == [
        (1, 0, "strict"),
        (0, 1, "strict"),
        (0, 0, "strict"),
        (1, 1, "fallback"),
        (1, 2, "fallback"),
    ]
    assert sel.counts == {"strict": 3, "fallback": 2, "cyclic": 0, "dropped": 0}


def test_whitespace_tokens_never_selected():
    scores = [_score([9.0, 1.0, 8.0]), _score([7.0])]
    cands = [np.array([False, True, False]), np.array([False])]
    sel = select_branch_points(scores, cands, budget=3)
    assert [(p.rollout, p.split, p.how) for p in sel.points] == [(0, 1, "strict"), (0, 1, "cyclic"), (0, 1, "cyclic")]
    assert select_branch_points(scores, [np.zeros(3, bool), np.zeros(1, bool)], budget=3).points == []


def test_cyclic_duplication_in_selection_order():
    sel = select_branch_points([_score([1.0, 2.0])], [np.ones(2, bool)], budget=5)
    assert [(p.split, p.how) for p in sel.points] == [
        (1, "strict"),
        (0, "strict"),
        (1, "cyclic"),
        (0, "cyclic"),
        (1, "cyclic"),
    ]
    assert sel.counts == {"strict": 2, "fallback": 0, "cyclic": 3, "dropped": 0}


def test_split_near_budget_is_dropped():
    """§3.3.5 / §3.11: points past max_split are dropped after selection; the count can fall short of B."""
    scores = [_score([1.0, 2.0, 5.0]), _score([4.0, 0.5])]
    cands = [np.ones(3, bool), np.ones(2, bool)]
    sel = select_branch_points(scores, cands, budget=3, max_split=[1, 1])
    assert [(p.rollout, p.split) for p in sel.points] == [(1, 0), (0, 1)]  # (0, 2) with BS 5 is dropped
    assert sel.counts == {"strict": 2, "fallback": 0, "cyclic": 0, "dropped": 1}
    refill = [c & (np.arange(c.size) <= m) for c, m in zip(cands, [1, 1])]
    sel = select_branch_points(scores, refill, budget=3, max_split=[1, 1])
    assert [(p.rollout, p.split) for p in sel.points] == [(1, 0), (0, 1), (0, 0)]


def test_ties_take_earliest_rollout_then_position():
    scores = [_score([1.0, 1.0]), _score([1.0, 2.0])]
    sel = select_branch_points(scores, [np.ones(2, bool)] * 2, budget=3)
    assert [(p.rollout, p.split) for p in sel.points] == [(1, 1), (0, 0), (0, 1)]


# ----------------------------------------------------------------------------------------------------------
# Future-KL loss (§3.7)


def _loop_suffix_sum(x: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(x)
    acc = torch.zeros(x.shape[0], dtype=x.dtype)
    for t in range(x.shape[1] - 1, -1, -1):
        acc = x[:, t] + gamma * acc
        out[:, t] = acc
    return out


@pytest.mark.parametrize("length", [1, 3, 4, 5, 128, 129, 300])
@pytest.mark.parametrize("chunk", [1, 4, 128])
@pytest.mark.parametrize("gamma", [1.0, 0.98923, 0.5])
def test_blocked_suffix_sum_equals_loop(length, chunk, gamma):
    x = torch.randn(3, length, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    torch.testing.assert_close(discounted_suffix_sum(x, gamma, chunk), _loop_suffix_sum(x, gamma), rtol=0, atol=1e-10)


def test_future_kl_hand_computed():
    """Δ = [0.1, −0.2, 2.0, 0.3], γ_f = 0.5 (decay_rate 1); Δ_2 = 2.0 > log 3 does not participate.

    FutureKL_3 = 0.3; _2 = 0 + 0.5·0.3 = 0.15; _1 = −0.2 + 0.5·0.15 = −0.125; _0 = 0.1 + 0.5·(−0.125) = 0.0375.
    f = clip(exp(·), 1, 1.2) = [1.038212, 1, 1.161834, 1.2].
    """
    params = FutureKLParams(decay_rate=1.0)
    delta = torch.tensor([[0.1, -0.2, 2.0, 0.3]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    fkl = future_kl(delta, mask, params)
    torch.testing.assert_close(fkl, torch.tensor([[0.0375, -0.125, 0.15, 0.3]], dtype=torch.float64))
    f = influence_factor(fkl, torch.ones(1, 4, dtype=torch.float64), delta.exp(), params)
    torch.testing.assert_close(
        f, torch.tensor([[1.038212, 1.0, 1.161834, 1.2]], dtype=torch.float64), rtol=0, atol=1e-6
    )
    masked = future_kl(delta, torch.tensor([[True, True, True, False]]), params)  # Δ_3 off the mask
    torch.testing.assert_close(masked, torch.tensor([[0.0, -0.2, 0.0, 0.0]], dtype=torch.float64))
    two_sided = influence_factor(
        fkl, torch.ones(1, 4, dtype=torch.float64), delta.exp(), FutureKLParams(decay_rate=1.0, clip_high_only=False)
    )
    assert float(two_sided[0, 1]) == pytest.approx(math.exp(-0.125), abs=1e-12)


def _loop_suffix_sum_at(x: torch.Tensor, pos: torch.Tensor, gamma: float) -> torch.Tensor:
    """S_t = x_t + γ^{pos_{t+1} − pos_t} S_{t+1}, entry by entry."""
    out = torch.zeros_like(x)
    acc = torch.zeros(x.shape[0], dtype=x.dtype)
    for t in range(x.shape[1] - 1, -1, -1):
        step = pos[:, t + 1] - pos[:, t] if t + 1 < x.shape[1] else torch.zeros(x.shape[0], dtype=x.dtype)
        acc = x[:, t] + gamma**step * acc
        out[:, t] = acc
    return out


@pytest.mark.parametrize("length", [1, 5, 129, 300])
@pytest.mark.parametrize("chunk", [1, 4, 128])
def test_blocked_suffix_sum_at_positions_equals_loop(length, chunk):
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(3, length, dtype=torch.float64, generator=gen)
    pos = torch.cumsum(torch.randint(1, 9, (3, length), generator=gen), dim=1).to(torch.float64)  # gaps 1..8
    torch.testing.assert_close(
        discounted_suffix_sum(x, 0.98923, chunk, pos), _loop_suffix_sum_at(x, pos, 0.98923), rtol=0, atol=1e-10
    )
    consecutive = torch.arange(length, dtype=torch.float64).expand(3, length)
    torch.testing.assert_close(
        discounted_suffix_sum(x, 0.98923, chunk, consecutive),
        discounted_suffix_sum(x, 0.98923, chunk),
        rtol=0,
        atol=1e-10,
    )


def test_future_kl_counts_observation_positions_hand_computed():
    """A two-turn row (§3.7 step 3 runs over every response position): policy tokens at positions 5, 6
    (turn 0) and 10, 11 (turn 1), observation tokens 7-9 between them. Δ = [0.1, 0.2, 0.3, 0.4], all
    below log 3; γ_f = 0.5 (decay_rate 1).

    FutureKL_11 = 0.4
    FutureKL_10 = 0.3 + 0.5^1·0.4 = 0.5
    FutureKL_6  = 0.2 + 0.5^4·0.3 + 0.5^5·0.4 = 0.2 + 0.01875 + 0.0125 = 0.23125
    FutureKL_5  = 0.1 + 0.5^1·0.2 + 0.5^5·0.3 + 0.5^6·0.4 = 0.1 + 0.1 + 0.009375 + 0.00625 = 0.215625
    (policy tokens only would give 0.1 + 0.1 + 0.075 + 0.05 = 0.325 at the first token.)
    With clip_high = 1 (f ≤ 2): f = exp(FutureKL) = [1.2406371, 1.2601742, 1.6487213, 1.4918247], and at
    A = 1, b = 1 the loss's mean_scale is 1 + mean f = 2.4103393.
    """
    params = FutureKLParams(decay_rate=1.0, clip_high=1.0)
    delta = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    positions = torch.tensor([[5, 6, 10, 11]])
    fkl = future_kl(delta, mask, params, positions)
    torch.testing.assert_close(
        fkl, torch.tensor([[0.215625, 0.23125, 0.5, 0.4]], dtype=torch.float64), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(future_kl(delta, mask, params)[0, 0], torch.tensor(0.325, dtype=torch.float64))
    f = influence_factor(fkl, torch.ones(1, 4, dtype=torch.float64), delta.exp(), params)
    torch.testing.assert_close(
        f, torch.tensor([[1.2406371, 1.2601742, 1.6487213, 1.4918247]], dtype=torch.float64), rtol=0, atol=1e-7
    )
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    terms = appo_future_kl_loss(
        old + delta, old, torch.ones(1, 4, dtype=torch.float64), mask, None, params, positions=positions
    )
    assert terms.extra["mean_scale"] == pytest.approx(2.4103393, abs=1e-7)
    padded = appo_future_kl_loss(  # the same row padded to 6 entries (padding positions are 0): same figures
        torch.cat([old + delta, torch.zeros(1, 2, dtype=torch.float64)], dim=1),
        torch.cat([old, torch.zeros(1, 2, dtype=torch.float64)], dim=1),
        torch.cat([torch.ones(1, 4), torch.zeros(1, 2)], dim=1).double(),
        torch.tensor([[True] * 4 + [False] * 2]),
        None,
        params,
        positions=torch.tensor([[5, 6, 10, 11, 0, 0]]),
    )
    assert padded.extra["mean_scale"] == pytest.approx(2.4103393, abs=1e-7)
    assert float(padded.loss) == pytest.approx(float(terms.loss), abs=1e-12)


def test_at_old_policy_factor_is_two_and_loss_is_minus_two_token_mean():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(3, 6, dtype=torch.float64, generator=gen) - 2.0
    logp = old.clone().requires_grad_(True)
    adv = torch.randn(3, 6, dtype=torch.float64, generator=gen)
    mask = torch.rand(3, 6, generator=gen) > 0.3
    terms = appo_future_kl_loss(logp, old, adv, mask, None, FutureKLParams())
    assert isinstance(terms, LossTerms)
    n = mask.sum()
    expected = -2.0 * (adv * mask).sum() / n
    torch.testing.assert_close(terms.loss, expected, rtol=0, atol=1e-12)
    assert terms.extra["mean_scale"] == 2.0 and terms.extra["rows_dropped"] == 0.0
    assert terms.clip_frac == 0.0 and terms.approx_kl == 0.0 and terms.ratio_mean == 1.0
    terms.loss.backward()
    torch.testing.assert_close(logp.grad, -2.0 * adv * mask / n, rtol=0, atol=1e-12)  # f is detached


def test_safety_clamp_and_dual_clip():
    """A = [−1, −1], Δ = [log 7, 1]: ρ_0 = 7 > 6 so f_0 → 1.0 (it would be 1.2: FutureKL_0 = γ_f·1 since p_0 = 0).

    Ã = [−2, −2.2]. Token 0: ℓ1 = 14, ℓ2 = 2·1.28, max 14 > 3·2 = 6 → dual clip 6 (one token: row kept).
    Token 1: ρ = e, ℓ = 2.2e = 5.980220 < 6.6. Loss = (6 + 5.980220)/2 = 5.990110.
    """
    params = FutureKLParams()
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[math.log(7.0), 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    delta = logp - old
    fkl = future_kl(delta, mask, params)
    assert float(fkl[0, 0]) == pytest.approx(params.gamma_f * 1.0, abs=1e-12)
    neg, pos = -torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    torch.testing.assert_close(
        influence_factor(fkl, neg, delta.exp(), params), torch.tensor([[1.0, 1.2]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        influence_factor(fkl, pos, delta.exp(), params), torch.tensor([[1.2, 1.2]], dtype=torch.float64)
    )
    terms = appo_future_kl_loss(logp, old, neg, mask, None, params)
    assert float(terms.loss) == pytest.approx((6.0 + 2.2 * math.e) / 2, abs=1e-9)
    assert terms.extra["dual_clip_frac"] == 0.5 and terms.extra["rows_dropped"] == 0.0
    assert terms.extra["mean_scale"] == pytest.approx(2.1, abs=1e-12)
    assert terms.clip_frac == 0.0  # A < 0 above the range: max(ℓ1, ℓ2) keeps the unclipped ℓ1


def test_row_with_two_dual_clips_is_dropped():
    """Row 0: two negative tokens with ρ = 7 are both dual-clipped → removed; row 1 at π_old gives −2A = −2."""
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = torch.tensor([[math.log(7.0), math.log(7.0)], [0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0]], dtype=torch.float64)
    terms = appo_future_kl_loss(logp, old, adv, torch.ones(2, 2, dtype=torch.bool), None, FutureKLParams())
    assert float(terms.loss) == pytest.approx(-2.0, abs=1e-12)
    assert terms.extra["rows_dropped"] == 1.0 and terms.extra["dual_clip_frac"] == 0.5


def test_off_mask_nan_never_reaches_loss_or_gradient():
    old = torch.tensor([[-1.0, float("nan"), -0.5]], dtype=torch.float64)
    logp = torch.tensor([[-0.9, float("nan"), -0.6]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0, float("nan"), -0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, float("nan"), -1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True]])
    terms = appo_future_kl_loss(logp, old, adv, mask, None, FutureKLParams(kl_coef=0.1), ref_logp=ref)
    terms.loss.backward()
    assert torch.isfinite(terms.loss) and torch.isfinite(logp.grad).all() and float(logp.grad[0, 1]) == 0.0


def test_kl_loss_low_var():
    """logp = 0, ref = log 0.5: r = −0.693147, e^r − r − 1 = 0.5 + 0.693147 − 1 = 0.193147."""
    logp = torch.zeros(1, 2, dtype=torch.float64)
    ref = torch.full((1, 2), math.log(0.5), dtype=torch.float64)
    adv = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    terms = appo_future_kl_loss(logp, logp, adv, mask, None, FutureKLParams(kl_coef=0.5), ref_logp=ref)
    assert float(terms.loss) == pytest.approx(0.5 * (0.5 + math.log(2) - 1), abs=1e-12)
    assert terms.kl_ref == pytest.approx(0.5 + math.log(2) - 1, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logp"):
        appo_future_kl_loss(logp, logp, adv, mask, None, FutureKLParams(kl_coef=0.5))


def test_loss_divisors_and_aggregation_pass_through():
    logp = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    terms = appo_future_kl_loss(logp, logp, adv, mask, None, FutureKLParams(), n_tokens_div=8)
    assert float(terms.loss) == pytest.approx(-2.0 * 5 / 8, abs=1e-12)
    terms = appo_future_kl_loss(logp, logp, adv, mask, None, FutureKLParams(aggregation="seq-mean-token-mean"))
    assert float(terms.loss) == pytest.approx(-2.0 * (1.0 + 2.0) / 2, abs=1e-12)


# ----------------------------------------------------------------------------------------------------------
# Registry and params


def test_registered_with_params():
    assert ADVANTAGES.get("appo").fn is appo_advantage and ADVANTAGES.get("appo").params_cls is APPOParams
    assert LOSSES.get("appo_future_kl").fn is appo_future_kl_loss
    assert LOSSES.get("appo_future_kl").params_cls is FutureKLParams
    assert FutureKLParams().gamma_f == pytest.approx(0.98923, abs=1e-5)
    with pytest.raises(ValueError):
        FutureKLParams(clip_ratio_c=1.0)
    with pytest.raises(ValueError):
        BranchingParams(omega_fallback="sometimes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        APPOParams().eps = 0.1  # frozen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_at_old_policy(dtype):
    """FutureKL runs in ≥ float32; the factor is still exactly 2 at π_θ = π_old."""
    logp = torch.full((2, 3), -1.25, dtype=dtype, requires_grad=True)
    adv = torch.tensor([[1.0, -0.5, 0.25], [0.0, 2.0, -1.0]], dtype=dtype)
    mask = torch.ones(2, 3, dtype=torch.bool)
    terms = appo_future_kl_loss(logp, logp.detach(), adv, mask, None, FutureKLParams())
    assert float(terms.loss.detach()) == pytest.approx(-2.0 * 1.75 / 6, abs=1e-6)  # Σ A = 1.75 over 6 tokens
    assert terms.extra["mean_scale"] == 2.0
    terms.loss.backward()
    assert logp.grad is not None and logp.grad.dtype == dtype


def test_empty_rollout_and_empty_batch():
    sc = branching_score(np.zeros(0), np.zeros(0), np.zeros(0), BranchingParams())
    assert sc.bs.shape == (0,) and not sc.omega_fallback
    assert select_branch_points([sc], [np.zeros(0, bool)], budget=4).points == []
    empty = make_batch([])
    res = appo_advantage(empty, APPOParams(), None)
    assert res.adv.shape == (0,) and res.adv_tokens.shape == (0,) and res.keep.shape == (0,)
