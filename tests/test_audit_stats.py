"""The credit audit's pure parts against exact vectors (docs/algorithms.md §8): the Monte Carlo advantage, the
noise ceiling, the agreements, the bootstrap, the draw of decision points and the continuations' returns."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from scipy.stats import spearmanr

from horizonrl.audit import points, scores, statistics, truth
from horizonrl.engines.base import Generation
from horizonrl.envs.base import Task
from horizonrl.rollout.records import EpisodeRecord, TurnRecord

NAN = float("nan")


def test_spearman_by_hand_with_and_without_ties():
    # d = (0, 1, 1, 0): rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert statistics.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ranks (1.5, 1.5, 3, 4) against (1, 2, 3, 4): 4.5 / sqrt(4.5 * 5) = sqrt(0.9)
    assert statistics.spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(math.sqrt(0.9))
    x, y = np.random.default_rng(0).normal(size=(2, 30))
    assert statistics.spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)
    assert math.isnan(statistics.spearman([1, 1, 1], [1, 2, 3])), "a constant vector orders nothing"
    rows = statistics.spearman_rows(np.array([[1, 2, 3, 4], [4, 3, 2, 1.0]]), np.array([[1, 3, 2, 4], [1, 2, 3, 4.0]]))
    assert rows == pytest.approx([0.8, -1.0])


def test_spearman_brown_corrects_a_half_to_the_whole():
    assert statistics.spearman_brown(0.5) == pytest.approx(2 / 3)
    assert [statistics.spearman_brown(r) for r in (0.0, 1.0, -1.0)] == [0.0, 1.0, -1.0]
    assert statistics.spearman_brown(np.array([0.5, -2.0])) == pytest.approx([2 / 3, -1.0])
    assert math.isnan(statistics.spearman_brown(NAN))


def test_monte_carlo_advantage_its_standard_error_and_halves():
    q = np.array([[1, 0, 1, 0], [1, NAN, 1, 1.0]])
    v = np.array([[0, 0, 1, 0], [0, 1, 0, 1.0]])
    q_mc, v_mc, a_mc, se = statistics.mc_advantage(q, v)
    assert q_mc == pytest.approx([0.5, 1.0]) and v_mc == pytest.approx([0.25, 0.5])
    assert a_mc == pytest.approx([0.25, 0.5])
    # s_Q^2 = 1/3, s_V^2 = 0.25 (4 returns each); second point: s_Q^2 = 0 (3 returns), s_V^2 = 1/3
    assert se == pytest.approx([math.sqrt(1 / 3 / 4 + 0.25 / 4), math.sqrt(0 / 3 + 1 / 3 / 4)])
    half1, half2 = statistics.split_halves(q, v)
    assert half1 == pytest.approx([1 - 0.5, 1 - 0.0]) and half2 == pytest.approx([0 - 0, 1 - 1])
    _, _, a_one, se_one = statistics.mc_advantage(np.array([[1.0, NAN]]), np.array([[0.0, 1.0]]))
    assert a_one == pytest.approx([0.5]) and math.isnan(se_one[0]), "one return: no variance, no standard error"


def test_agreement_significance_and_ordering_pairs():
    assert statistics.agreement(np.array([0.5, -1, 0, 2]), np.array([1, 1, -1, -3])).tolist() == [1, 0, 0.5, 0]
    mask = statistics.significant(np.array([0.3, 0.1, -0.5, NAN]), np.array([0.1, 0.1, 0.2, 0.1]), 2.0)
    assert mask.tolist() == [True, False, True, False]
    anchor = np.array([0, 0, 0, -1, 1, 1])
    action = np.array(["a", "b", "a", "a", "a", "b"])
    q = np.array([1, 0, 1, 1, 0.5, 0.5])
    # (0, 2) share an action, point 3 has no anchor, (4, 5) tie in value: none of them is a pair
    assert statistics.ordering_pairs(anchor, action, q).tolist() == [[0, 1], [1, 2]]


def test_bootstrap_resamples_whole_units_and_pairs_estimators():
    full, boot = statistics.bootstrap_means(np.array([[1.0, 1.0, 0.0]]), np.array([0, 0, 1]), 500, 0)
    assert full == pytest.approx([2 / 3])
    assert set(np.round(boot[:, 0], 6)) <= {0.0, round(2 / 3, 6), 1.0}, "a unit's items are drawn together"
    a_mc = np.random.default_rng(1).normal(size=40)
    est = np.stack([a_mc, a_mc, -a_mc])
    full, boot = statistics.bootstrap_spearman(est, a_mc, 300, 2)
    assert full == pytest.approx([1, 1, -1]) and (boot[:, 0] == boot[:, 1]).all(), "the same resamples for each"
    e = statistics.interval(0.5, np.linspace(0, 1, 101), 10)
    assert (e.low, e.high) == pytest.approx((0.025, 0.975))
    assert math.isnan(statistics.interval(0.5, np.array([1.0]), 1).low), "one unit: no interval"


def test_scores_pair_estimators_on_the_same_points_and_score_partial_ones_on_their_own():
    rng = np.random.default_rng(3)
    a_mc = rng.normal(size=60)
    table = pd.DataFrame({
        "a_mc": a_mc, "se": np.full(60, 0.1), "q_mc": a_mc, "a_half1": a_mc + rng.normal(0, 0.3, 60),
        "a_half2": a_mc + rng.normal(0, 0.3, 60), "anchor": np.repeat(np.arange(20), 3),
        "action": np.tile(["x", "y", "z"], 20), "truth": a_mc, "noise": rng.normal(size=60),
        "part": np.where(np.arange(60) < 30, a_mc, np.nan),
    })  # fmt: skip
    result = scores.score(table, ["truth", "noise", "part"], 500, 0, 2.0)
    truth_scores = result["estimators"]["truth"]
    assert truth_scores["spearman"].value == 1 and truth_scores["sign_agreement"].value == 1
    assert truth_scores["ordering"].value == 1 and truth_scores["ordering"].n == 60  # 3 pairs at each of 20 states
    assert result["estimators"]["part"]["spearman"].n == 30, "scored where it is defined"
    assert {(p["a"], p["b"]) for p in result["pairs"]} == {("truth", "noise")}, "only the fully defined are paired"
    difference = next(p for p in result["pairs"] if p["metric"] == "spearman")["difference"]
    assert difference.low > 0.5
    assert 0.8 < result["noise_ceiling"].value < 1 and result["max_correlation"] > result["noise_ceiling"].value


def test_a_figure_undefined_in_many_resamples_gets_no_interval():
    """One informative point in 20 (the rest tie at A_MC = 0): its Spearman correlation is a number, but most
    resamples leave that point out and are undefined, so no interval is claimed."""
    a_mc = np.zeros(20)
    a_mc[3] = -0.25
    table = pd.DataFrame({"a_mc": a_mc, "se": np.full(20, 0.25), "q_mc": np.zeros(20), "a_half1": a_mc,
                          "a_half2": np.zeros(20), "anchor": -np.ones(20, int), "action": ["x"] * 20,
                          "est": np.linspace(-1, 1, 20)})  # fmt: skip
    result = scores.score(table, ["est"], 1000, 0, 2.0)
    spear = result["estimators"]["est"]["spearman"]
    assert np.isfinite(spear.value) and math.isnan(spear.low) and math.isnan(spear.high)
    assert result["points_nonzero"] == 1 and math.isnan(result["noise_ceiling"].value), "a constant half"


def test_phases_and_anchor_codes():
    assert [points.phase(t, 3) for t in range(3)] == ["early", "middle", "late"]
    assert [points.phase(0, 1), points.phase(5, 6), points.phase(1, 6)] == ["early", "late", "early"]
    frame = pd.DataFrame({"group_id": [0, 0, 0, 1, 1], "observation": ["o", "o", "p", "o", "o"],
                          "action": ["a", "b", "a", "a", "a"]})  # fmt: skip
    assert points.anchor_codes(frame).tolist() == [0, 0, -1, -1, -1], "group 1's state was left by one action only"


def _frame() -> pd.DataFrame:
    """60 decisions: 2 families, 6 groups of 2 episodes of 5 turns (one in 6 won), turn 0 an anchor state left
    two ways."""
    rows = []
    for rid in range(12):
        for t in range(5):
            rows.append({"rollout_id": rid, "group_id": rid // 2, "turn": t, "n_turns": 5, "task_id": f"t{rid // 2}",
                         "family": "f1" if rid < 6 else "f2", "observation": "start" if t == 0 else f"o{rid}-{t}",
                         "action": f"a{rid % 2}" if t == 0 else "x", "won": rid % 6 == 0})  # fmt: skip
    frame = pd.DataFrame(rows)
    frame["phase"] = [points.phase(t, n) for t, n in zip(frame["turn"], frame["n_turns"])]
    return frame


def test_pick_points_covers_every_stratum_and_anchor_states_in_pairs():
    picked = points.pick_points(_frame(), 18, 0.3, seed=7)
    assert len(picked) == 18 and picked["point"].tolist() == list(range(18))
    assert picked[["rollout_id", "turn"]].apply(tuple, axis=1).is_unique
    assert list(zip(picked["rollout_id"], picked["turn"])) == sorted(zip(picked["rollout_id"], picked["turn"]))
    strata = set(zip(_frame()["family"], _frame()["phase"], _frame()["won"]))
    assert len(strata) == 12 and set(zip(picked["family"], picked["phase"], picked["won"])) == strata
    assert picked["won"].sum() >= 6, "won episodes are 1 in 6 of the decisions, at least 1 in 3 of the points"
    anchored = picked[picked["anchor"] >= 0]
    assert len(anchored) >= 4 and (anchored.groupby("anchor")["action"].nunique() == 2).all()
    assert points.pick_points(_frame(), 18, 0.3, seed=7).equals(picked), "fixed by the seed"
    assert len(points.pick_points(_frame(), 500, 0.3, seed=1)) == 60, "never more than there are"


def _parent(rid: int, rewards: list[float]) -> EpisodeRecord:
    turns = [TurnRecord(t, f"o{t}", "a", [1], Generation([5, 6], [0.0, 0.0], [0.0, 0.0], [True, False]), r,
                        t == len(rewards) - 1, False, True, True, 0.0, "", "", 2, 0.0, 0.0)
             for t, r in enumerate(rewards)]  # fmt: skip
    return EpisodeRecord(rid, 0, Task("household", "train", "easy", 0, 0), "full", 0, turns=turns)


def test_continuations_returns_count_from_the_decision_on():
    parents = {7: _parent(7, [0.5, 0.0, 1.0]), 8: _parent(8, [0.0, 2.0])}
    block = pd.DataFrame({"point": [0, 1], "rollout_id": [7, 8], "turn": [1, 1]})
    plan = truth.plan(block, parents, 2)
    assert [(c.point, c.arm, c.start) for c in plan] == [(0, "fresh", 1), (0, "fresh", 1), (0, "fixed", 2),
                                                         (0, "fixed", 2), (1, "fresh", 1), (1, "fresh", 1)]  # fmt: skip
    # the episodes' whole returns: the 0.5 of turn 0 (replayed) is left out of every return
    episodes = pa.table({"episode_return": [0.5, 1.5, 1.5, 0.5, 0.0, 3.0],
                         "status": ["done", "won", "won", "error", "done", "won"]})  # fmt: skip
    q, v = truth.returns(block, parents, plan, episodes, 2)
    assert v.tolist() == [[0.0, 1.0], [0.0, 3.0]]
    assert q[0, 0] == 1.0 and math.isnan(q[0, 1]), "a continuation that failed is no return"
    assert q[1].tolist() == [2.0, 2.0], "the episode ended with the decision: Q is its reward, nothing played"


def test_branch_turns_name_the_turn_that_holds_each_of_appos_split_tokens():
    # rollout 3's turns have 3, 4 and 2 action tokens (flat ends 3, 7, 9): splits 1 and 5 fall in turns 0 and 1
    turns = pa.table({"rollout_id": [3, 3, 3, 9], "turn": [2, 0, 1, 0], "action_ids": [[1] * 2, [1] * 3, [1] * 4, [1]]})
    episodes = pa.table({"kind": ["initial", "branch", "branch", "branch"], "parent_rollout": [-1, 3, 3, 9],
                         "branch_token": [-1, 1, 5, 0]})  # fmt: skip
    assert points.branch_turns(episodes, turns) == {(3, 0), (3, 1), (9, 0)}


def test_blpo_is_warmed_from_every_batch_before_the_checkpoint_or_from_none(tmp_path):
    from horizonrl.audit.policy import stored_batches

    run = tmp_path / "exp" / "run"
    for i in (1, 2):
        (run / f"iter={i:05d}").mkdir(parents=True)
        for name in ("episodes.parquet", "turns.parquet"):
            (run / f"iter={i:05d}" / name).touch()
    assert [d.name for d in stored_batches(run, 2)] == ["iter=00001", "iter=00002"]
    assert stored_batches(run, 3) == [], "iteration 3's batch is missing: no partial memory"
    assert stored_batches(run, 0) == []
