"""BLPO (methods/blpo.py, methods/blpo_memory.py; docs/algorithms.md §2, §5, §7.3).

The confidence example of section 5 (on memory records and through the full estimator), the edge
cases of 2.12, decay (7.3: n_eff = 1.996 is inactive; a half-life halves W), the memory's JSON round
trip, purity (the input memory is not changed) and bit-for-bit determinism. Tolerance 1e-12
absolute unless stated; the spec's printed figures (0.2621) are checked to 5e-5.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from methods.blpo import BLPOParams, blpo_advantage
from methods.blpo_memory import (
    BLPOMemory,
    KeyCodes,
    MomentRecord,
    context_hashes,
    read_progress_keys,
    role_progress_advantage,
    role_support,
)
from methods.registry import ADVANTAGES
from methods.types import StepBatch

ATOL = 1e-12
EPS = 1e-6
READ = BLPOParams().progress_read  # the default read settings (ALFWorld's)
LAMBDA = 2.0 ** (-1.0 / 8.0)
# Section 5: m = (0.4, -0.3), M = 0.05, s^2 = 0.245, c = +-0.35, n_cmp = HM(3, 2) = 2.4, kappa = 2.4 / 6.4
# = 0.375, SE_D^2 = (1/2)^2 (0.01/3) + (0.02/2)/4 = 0.000833 + 0.0025 for A (the same for B), tau^2 = 0.0025.
A_P = 0.375 * 0.35 / math.sqrt(0.245 + 0.25 * 0.01 / 3 + 0.01 / 4 + 0.05**2)  # 0.2620636


def row(uid, traj, reward, obs, action, role, abstract, context, **extra) -> dict:
    return dict(uid=uid, traj=traj, reward=reward, obs=obs, action=action, role=role, abstract=abstract,
                context=context, **extra)  # fmt: skip


def blpo_batch(rows: list[dict], update_index: int = 0) -> StepBatch:
    """Rows in order; episode_return defaults to the trajectory's summed reward, flags to True."""
    total = defaultdict(float)
    for r in rows:
        total[r["traj"]] += r["reward"]
    turn, seen = [], defaultdict(int)
    for r in rows:
        turn.append(seen[r["traj"]])
        seen[r["traj"]] += 1

    def col(name, default=None, dtype=object):
        return np.asarray([r.get(name, default) for r in rows], dtype=dtype)

    return StepBatch(
        group_id=col("uid", dtype=np.int64),
        traj_id=col("traj", dtype=np.int64),
        turn=np.asarray(turn, dtype=np.int64),
        reward=col("reward", dtype=np.float64),
        episode_return=np.asarray([r.get("ret", total[r["traj"]]) for r in rows], dtype=np.float64),
        n_tokens=np.ones(len(rows), dtype=np.int64),
        update_index=update_index,
        anchor_obs=col("obs"),
        action=col("action"),
        valid=col("valid", True, bool),
        format_valid=col("fmt", True, bool),
        progress_key=col("role"),
        abstract_action=col("abstract"),
        context_id=col("context"),
        shareable=col("shareable", True, bool),
    )


def pair_z(a: float, b: float) -> float:
    """(a - mean) / (std_ddof1 + eps) for the first of two values: (a - b)/2 / (|a - b|/sqrt(2) + eps)."""
    return (a - b) / 2 / (abs(a - b) / math.sqrt(2) + EPS)


# Section 5 through the estimator: five single-step task groups, each one Exact group (its own
# observation and context) holding a role-R row and a role-R2 row whose abstract action X makes the
# group eligible. delta = G - mean_E G of the R rows: A {0.5, 0.3, 0.4}, B {-0.2, -0.4}.
CONFIDENCE_SPEC = [("A", 1.0, 0.0), ("A", 0.6, 0.0), ("A", 0.8, 0.0), ("B", 0.0, 0.4), ("B", 0.0, 0.8)]


def confidence_rows() -> list[dict]:
    rows = []
    for i, (action, g_role, g_other) in enumerate(CONFIDENCE_SPEC, start=1):
        rows.append(row(i, 2 * i, g_role, f"room {i}", f"do {action}", "R", action, f"ctx{i}"))
        rows.append(row(i, 2 * i + 1, g_other, f"room {i}", "do x", "R2", "X", f"ctx{i}"))
    return rows


def split_progress(result, rows, mode: str = "mean_std_norm") -> np.ndarray:
    """A^P of the R rows: adv - A^E - (2/3) A^X, times 3 (both layers active, priors 1 and 0.5)."""
    out = []
    for n in range(0, len(rows), 2):
        a, b = rows[n]["reward"], rows[n + 1]["reward"]
        z = pair_z(a, b) if mode == "mean_std_norm" else (a - b) / 2  # A^E and A^X of the pair are both z
        out.append(3 * (result.adv[n] - z - 2 / 3 * z))
    return np.asarray(out)


def confidence_records() -> dict[str, MomentRecord]:
    # A: W = 3, S = 0.5+0.3+0.4 = 1.2, Q = 0.25+0.09+0.16 = 0.5, R = 3; B: W = 2, S = -0.6, Q = 0.2, R = 2.
    return {
        "A": MomentRecord(3.0, 1.2, 0.5, 3.0, 0, {"c1": 1.0, "c2": 1.0, "c3": 1.0}),
        "B": MomentRecord(2.0, -0.6, 0.2, 2.0, 0, {"c4": 1.0, "c5": 1.0}),
    }


def test_confidence_example_from_records():
    read = role_progress_advantage(confidence_records(), READ)
    assert read.active and read.n_eff == 5.0
    assert read.score == pytest.approx({"A": 0.4, "B": -0.3}, abs=ATOL)
    assert read.adv["A"] == pytest.approx(A_P, abs=ATOL) and read.adv["B"] == pytest.approx(-A_P, abs=ATOL)
    assert abs(read.adv["A"] - 0.2621) < 5e-5
    # mean_norm: A^P = c_a = +-0.35; confidence off: c / s = +-0.35 / 0.494975 = +-0.707107 (the raw z).
    assert role_progress_advantage(confidence_records(), replace(READ, mode="mean_norm")).adv["A"] == pytest.approx(
        0.35, abs=ATOL
    )
    raw = role_progress_advantage(confidence_records(), replace(READ, confidence=False)).adv["B"]
    assert raw == pytest.approx(-0.35 / math.sqrt(0.245), abs=ATOL)


def test_confidence_example_through_estimator():
    rows = confidence_rows()
    result = blpo_advantage(blpo_batch(rows), BLPOParams(), None)
    # Empty memory: this batch is written first, then read (2.7 (e)), so A^P is active at once.
    np.testing.assert_allclose(split_progress(result, rows), [A_P] * 3 + [-A_P] * 2, rtol=0, atol=1e-10)
    # R2 has one action (X) -> inactive: its rows get A^E + A^X.
    for n in range(1, len(rows), 2):
        z = pair_z(rows[n]["reward"], rows[n - 1]["reward"])
        assert result.adv[n] == pytest.approx(2 * z, abs=ATOL)
    memory = result.state
    a, b = memory.get("R", "A"), memory.get("R", "B")
    assert (a.W, a.R, b.W, b.R) == (3.0, 3.0, 2.0, 2.0) and len(memory) == 3
    assert (a.S, a.Q, b.S, b.Q) == pytest.approx((1.2, 0.5, -0.6, 0.2), abs=ATOL)
    assert a.children == dict(sorted(zip(context_hashes([f"ctx{i}" for i in (1, 2, 3)]), [1.0] * 3)))
    assert result.stats["active_roles"] == 1.0 and result.stats["progress_active_fraction"] == 0.5
    assert result.stats["memory_keys"] == 3.0 and result.stats["exact_active_fraction"] == 1.0


def test_confidence_example_mean_norm():
    rows = confidence_rows()
    result = blpo_advantage(blpo_batch(rows), BLPOParams(mode="mean_norm"), None)
    # mean_norm: A^P = c_a = m_a - M = 0.4 - 0.05 = 0.35 and -0.3 - 0.05 = -0.35; A^E, A^X = (a - b)/2.
    np.testing.assert_allclose(split_progress(result, rows, "mean_norm"), [0.35] * 3 + [-0.35] * 2, atol=1e-10)


def test_children_sorted_and_reload_gives_same_bits():
    memory = blpo_advantage(blpo_batch(confidence_rows()), BLPOParams(), None).state
    for row_ in memory.records():
        children = memory.get(row_["role"], row_["action"]).children
        assert list(children) == sorted(children)
    reloaded = BLPOMemory.from_json_dict(json.loads(json.dumps(memory.to_json_dict())), half_life=8.0)
    batch = blpo_batch(confidence_rows() + two_action_group(7, "c7"), update_index=2)
    direct, via_file = blpo_advantage(batch, BLPOParams(), memory), blpo_advantage(batch, BLPOParams(), reloaded)
    assert direct.adv.tobytes() == via_file.adv.tobytes() and direct.state == via_file.state


def test_exact_balance_versus_per_row_term():
    # Action a twice (G = 1 and 0), action b once (G = 0.5): score_a = score_b = mu = 0.5, so the balanced
    # layer is inactive although sigma = 0.5 > 0; the per-row term gives (G - 0.5) / (0.5 + eps) (2.6).
    rows = [row(1, 1, 1.0, "o", "do a", "R", "A", "c", ret=0.0), row(1, 2, 0.0, "o", "do a", "R", "A", "c"),
            row(1, 3, 0.5, "o", "do b", "R", "A", "c", ret=0.0)]  # fmt: skip
    balanced = blpo_advantage(blpo_batch(rows), BLPOParams(), None)
    assert np.all(balanced.adv == 0.0) and balanced.stats["exact_active_fraction"] == 0.0
    per_row = blpo_advantage(blpo_batch(rows), BLPOParams(exact_action_balance=False), None)
    np.testing.assert_allclose(per_row.adv, [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0], rtol=0, atol=ATOL)
    tied = [dict(r, reward=0.3, ret=0.3) for r in rows]  # all-tied group: inactive, exactly 0 (7.3)
    assert np.all(blpo_advantage(blpo_batch(tied), BLPOParams(exact_action_balance=False), None).adv == 0.0)


def test_non_shareable_rows_neither_write_nor_read():
    rows = confidence_rows()
    rows[0]["shareable"] = False  # context 1's role-R row: its group keeps one shareable row -> no write
    result = blpo_advantage(blpo_batch(rows), BLPOParams(), None)
    assert result.state.get("R", "A").W == 2.0 and result.state.get("R2", "X").W == 4.0
    assert result.adv[0] == pytest.approx(2 * pair_z(1.0, 0.0), abs=ATOL)  # A^E + A^X, no A^P
    assert result.stats["progress_active_fraction"] == pytest.approx(4 / 10, abs=ATOL)


def test_read_before_write_lags_one_update():
    rows = confidence_rows()
    lagged = blpo_advantage(blpo_batch(rows), BLPOParams(role_read_before_write=True), None)
    assert lagged.stats["progress_active_fraction"] == 0.0  # the empty memory was read
    expected = [2 * pair_z(rows[n]["reward"], rows[n ^ 1]["reward"]) for n in range(len(rows))]
    np.testing.assert_allclose(lagged.adv, expected, rtol=0, atol=ATOL)  # micro = A^X only
    assert lagged.state == blpo_advantage(blpo_batch(rows), BLPOParams(), None).state


def test_current_batch_centering():
    rows = confidence_rows()
    result = blpo_advantage(blpo_batch(rows), BLPOParams(role_current_batch_center=True), None)
    # Active A^P: +a on 3 rows, -a on 2 -> mean a/5; centred: 0.8 a and -1.2 a.
    np.testing.assert_allclose(split_progress(result, rows), [0.8 * A_P] * 3 + [-1.2 * A_P] * 2, atol=1e-10)


def test_singleton_exact_group_reads_history_without_writing():
    first = blpo_advantage(blpo_batch(confidence_rows()), BLPOParams(), None)
    lone = [row(9, 99, 0.3, "new room", "do A", "R", "A", "ctx9")]
    result = blpo_advantage(blpo_batch(lone, update_index=1), BLPOParams(), first.state)
    # A^E = 0 (group of one), A^X = 0 (Exact group of one); A^P from the decayed history: decay scales
    # W, S, Q, children by lambda and R by lambda^2, which leaves m, s, v, n_eff and so A^P unchanged.
    assert result.adv[0] == pytest.approx(A_P, abs=1e-10)
    assert result.stats["exact_active_fraction"] == 0.0
    assert result.state.get("R", "A") == first.state.get("R", "A")  # not written
    assert result.state.update_index == 1


def test_empty_memory_single_context_is_inactive():
    # One Exact group with both actions of role R: n_eff = 1 < 2, so micro = A^X only (2.12).
    rows = [row(1, 1, 1.0, "o", "do a", "R", "A", "c1"), row(1, 2, 0.0, "o", "do b", "R", "B", "c1")]
    result = blpo_advantage(blpo_batch(rows), BLPOParams(), None)
    z = pair_z(1.0, 0.0)
    np.testing.assert_allclose(result.adv, [2 * z, -2 * z], rtol=0, atol=ATOL)
    assert result.stats["progress_active_fraction"] == 0.0 and len(result.state) == 2


def test_identical_task_rewards_leave_discounting_differences():
    # Both trajectories reach reward 1 (A^E = 0 exactly); the short one has G = 0.95 at "s0", the long
    # one 0.95^2 = 0.9025, so only the shared "s0" rows get A^X = +-pair_z.
    rows = [
        row(1, 1, 0.0, "s0", "go to a", "R0", "NAV", "c0"), row(1, 1, 1.0, "s1", "take x", "R1", "TAKE", "c1"),
        row(1, 2, 0.0, "s0", "go to b", "R0", "SEARCH", "c0"), row(1, 2, 0.0, "s2", "look", "R2", "LOOK", "c2"),
        row(1, 2, 1.0, "s3", "take x", "R1", "TAKE", "c3"),
    ]  # fmt: skip
    result = blpo_advantage(blpo_batch(rows), BLPOParams(), None)
    z = pair_z(0.95, 0.9025)
    np.testing.assert_allclose(result.adv, [z, 0, -z, 0, 0], rtol=0, atol=ATOL)
    assert result.adv[1] == 0.0 and result.adv[3] == 0.0 and result.stats["mean_abs_adv_episode"] == 0.0
    failed = [dict(r, reward=0.0) for r in rows]
    assert np.all(blpo_advantage(blpo_batch(failed), BLPOParams(), None).adv == 0.0)


def test_one_rollout_per_task_uses_revisits_only():
    # K = 1: A^E = 0; the trajectory revisits "s0" with another action: G = 0.9025 vs 1.
    rows = [row(4, 1, 0.0, "s0", "open door", "R", "OPEN", "c0"), row(4, 1, 0.0, "s1", "look", "R", "LOOK", "c1"),
            row(4, 1, 1.0, "s0", "go north", "R", "NAV", "c0")]  # fmt: skip
    result = blpo_advantage(blpo_batch(rows), BLPOParams(), None)
    z = pair_z(0.9025, 1.0)
    np.testing.assert_allclose(result.adv, [z, 0, -z], rtol=0, atol=ATOL)


def test_canonical_actions_balance_and_validity():
    # One Exact group. "Go to  Desk" and "go to desk" (valid) are one action a with G = (1, 0): score 0.5;
    # the invalid "go to desk" is another action (r' = 0.1 - 0.1 = 0), "look" a third (G = 0).
    # mu = 0.25, sigma^2 = (0.75^2 + 3 * 0.25^2) / 3 = 0.25; A^X = (0.25, 0.25, -0.25, -0.25) / (0.5 + eps).
    rows = [row(1, 1, 1.0, "o", "Go to  Desk", "R", "NAV", "c"), row(1, 2, 0.0, "o", "go to desk", "R", "NAV", "c"),
            row(1, 3, 0.1, "o", "go to desk", "R", "NAV", "c", valid=False),
            row(1, 4, 0.0, "o", "look", "R", "NAV", "c")]  # fmt: skip
    result = blpo_advantage(blpo_batch(rows), BLPOParams(), None)
    # A^E on scores (1, 0, 0, 0): (0.75, -0.25, -0.25, -0.25) / (0.5 + eps). One abstract action: no write.
    expected = np.array([1.0, 0.0, -0.5, -0.5]) / (0.5 + EPS)
    np.testing.assert_allclose(result.adv, expected, rtol=0, atol=ATOL)
    assert len(result.state) == 0


def test_non_finite_and_missing_inputs_raise():
    batch = blpo_batch(confidence_rows())
    for name, value in (("reward", np.nan), ("episode_return", np.inf)):
        column = getattr(batch, name).copy()
        column[3] = value
        with pytest.raises(ValueError, match=name):
            blpo_advantage(StepBatch(**{**batch.__dict__, name: column}), BLPOParams(), None)
    with pytest.raises(ValueError, match="progress_key"):
        blpo_advantage(StepBatch(**{**batch.__dict__, "progress_key": None}), BLPOParams(), None)
    with pytest.raises(ValueError, match="half_life"):
        blpo_advantage(batch, BLPOParams(), BLPOMemory(half_life=4.0))


def two_action_group(uid: int, context: str) -> list[dict]:
    return [row(uid, 2 * uid, 1.0, context, "do a", "R", "A", context),
            row(uid, 2 * uid + 1, 0.0, context, "do b", "R", "B", context)]  # fmt: skip


def test_role_support_takes_the_max_weight_per_context():
    # c1 has weight 1 under A and 0.5 under B: support (c1: 1, c2: 1) -> n_eff = 2^2 / 2 = 2.
    records = {"A": MomentRecord(1.0, 1.0, 1.0, 1.0, 0, {"c1": 1.0}),
               "B": MomentRecord(1.5, 0.0, 1.0, 1.25, 0, {"c1": 0.5, "c2": 1.0})}  # fmt: skip
    assert role_support(records) == 2.0 and role_progress_advantage(records, READ).active


def test_contexts_one_update_apart_are_inactive():
    first = blpo_advantage(blpo_batch(two_action_group(1, "c1")), BLPOParams(), None)
    second = blpo_advantage(blpo_batch(two_action_group(2, "c2"), update_index=1), BLPOParams(), first.state)
    # Support: c1 at lambda = 2^(-1/8), c2 at 1 -> n_eff = (1 + lambda)^2 / (1 + lambda^2) = 1.99626 < 2.
    read = role_progress_advantage(second.state.role_records("R", 1, EPS), READ)
    assert read.n_eff == pytest.approx((1 + LAMBDA) ** 2 / (1 + LAMBDA**2), abs=ATOL)
    assert read.n_eff == pytest.approx(1.996, abs=5e-4) and not read.active
    assert second.stats["active_roles"] == 0.0 and second.stats["progress_active_fraction"] == 0.0
    both = blpo_advantage(blpo_batch(two_action_group(1, "c1") + two_action_group(2, "c2")), BLPOParams(), None)
    assert both.stats["active_roles"] == 1.0 and both.stats["progress_active_fraction"] == 1.0  # n_eff = 2


def test_half_life_halves_weight_after_eight_updates():
    b, c = context_hashes(["b", "c"])  # children are keyed by context hashes (32 hex digits)
    memory = BLPOMemory(8.0).with_effects(0, [("R", "A")], [[1.0], [0.4], [0.16], [1.0]], ([c], [1.0], [0, 1]))
    later = memory.role_records("R", 8, EPS)["A"]
    assert later.W == pytest.approx(0.5, rel=1e-14) and later.S == pytest.approx(0.2, rel=1e-14)
    assert later.R == pytest.approx(0.25, rel=1e-14) and later.children[c] == pytest.approx(0.5, rel=1e-14)
    grown = memory.with_effects(8, [("R", "A")], [[1.0], [0.0], [0.0], [1.0]], ([b], [1.0], [0, 1])).get("R", "A")
    assert grown.W == pytest.approx(1.5, rel=1e-14) and grown.last_update == 8
    assert grown.children == pytest.approx({b: 1.0, c: 0.5}, rel=1e-14) and list(grown.children) == sorted([b, c])
    again = memory.with_effects(8, [("R", "A")], [[1.0], [0.0], [0.0], [1.0]], ([c], [1.0], [0, 1])).get("R", "A")
    assert again.children == pytest.approx({c: 1.5}, rel=1e-14)  # the same context: 0.5 decayed + 1
    assert memory.get("R", "A").W == 1.0  # with_effects returned a new memory
    with pytest.raises(ValueError, match="backwards"):
        grown_memory = memory.with_effects(8, [], [[], [], [], []], ([], [], [0]))
        grown_memory.with_effects(7, [], [[], [], [], []], ([], [], [0]))
    with pytest.raises(ValueError, match="hex"):
        memory.with_effects(8, [("R", "A")], [[1.0], [0.0], [0.0], [1.0]], (["c"], [1.0], [0, 1]))
    faded = MomentRecord(1.0, 1.0, 1.0, 1.0, 0, {"c": 1.0}).decayed(8 * 34, LAMBDA)
    assert faded.children == {}  # 2^-34 = 5.8e-11 <= 1e-10: pruned
    pruned = memory.with_effects(8 * 34, [("R", "A")], [[1.0], [0.0], [0.0], [1.0]], ([b], [1.0], [0, 1]))
    assert pruned.get("R", "A").children == {b: 1.0}  # c decayed below 1e-10 is dropped on write


def test_memory_json_round_trip():
    memory = blpo_advantage(blpo_batch(confidence_rows()), BLPOParams(), None).state
    text = json.dumps(memory.to_json_dict())
    loaded = BLPOMemory.from_json_dict(json.loads(text), half_life=8.0)
    assert loaded == memory and json.dumps(loaded.to_json_dict()) == text and len(loaded) == 3
    assert loaded.get("R", "A") == memory.get("R", "A")
    with pytest.raises(ValueError, match="half-life"):
        BLPOMemory.from_json_dict(json.loads(text), half_life=4.0)
    flat = {(r["role"], r["action"]): r for r in memory.records()}
    assert flat[("R", "A")]["n_children"] == 3 and flat[("R", "A")]["mean"] == pytest.approx(0.4, abs=ATOL)
    assert list(flat) == sorted(flat)


def test_estimator_is_pure_and_deterministic():
    state = blpo_advantage(blpo_batch(confidence_rows()), BLPOParams(), None).state
    before = json.dumps(state.to_json_dict())
    batch = blpo_batch(confidence_rows() + two_action_group(7, "c7"), update_index=3)
    one, two = (blpo_advantage(batch, BLPOParams(), state) for _ in range(2))
    assert json.dumps(state.to_json_dict()) == before and one.state is not state
    assert one.adv.tobytes() == two.adv.tobytes()
    assert json.dumps(one.state.to_json_dict()) == json.dumps(two.state.to_json_dict())
    # (R, A): 3 effects decayed over 3 updates, plus 3 (contexts 1-3 again) + 1 (context c7) new ones.
    assert one.state.get("R", "A").W == pytest.approx(3 * LAMBDA**3 + 4, abs=ATOL)


def test_local_residual_rescues_a_tied_group():
    # A sixth context where A, B and an R2 action X tie (G = 0.5): delta = 0, so m_A = 1.2/4 = 0.3 and
    # m_B = -0.6/3 = -0.2 (role R stays active with 6 contexts).
    rows = confidence_rows() + [row(6, 12, 0.5, "room 6", "do a", "R", "A", "ctx6"),
                                row(6, 13, 0.5, "room 6", "do b", "R", "B", "ctx6"),
                                row(6, 14, 0.5, "room 6", "do x", "R2", "X", "ctx6")]  # fmt: skip
    result = blpo_advantage(blpo_batch(rows), BLPOParams(role_application="local_residual"), None)
    # Tied group: direct = 0; reliable rows A, B: projected = m - mean(0.3, -0.2) = +-0.25, X: 0;
    # combined = 0.5 * projected = (0.125, -0.125, 0), mean 0, std (ddof 1) = 0.125. A^E = 0 (tied).
    rescued = 0.125 / (0.125 + EPS)
    np.testing.assert_allclose(result.adv[-3:], [rescued, -rescued, 0.0], rtol=0, atol=ATOL)
    # Other groups have one reliable row each: micro is GiGPO's per-row term, so A = 2 pair_z.
    expected = [2 * pair_z(rows[n]["reward"], rows[n ^ 1]["reward"]) for n in range(10)]
    np.testing.assert_allclose(result.adv[:10], expected, rtol=0, atol=1e-10)
    assert result.stats["progress_active_fraction"] == pytest.approx(2 / 13, abs=ATOL)


def test_registered_and_params_validated():
    entry = ADVANTAGES.get("blpo")
    assert entry.fn is blpo_advantage and entry.params_cls is BLPOParams
    with pytest.raises(ValueError, match="local_residual"):
        BLPOParams(role_application="local_residual", role_current_batch_center=True)
    with pytest.raises(ValueError, match="std_floor"):
        BLPOParams(std_floor=0.5)
    exact_only = blpo_advantage(blpo_batch(confidence_rows()), BLPOParams(layers=("exact",)), None)
    assert len(exact_only.state) == 0 and exact_only.stats["progress_active_fraction"] == 0.0


def random_rows(seed: int) -> list[dict]:
    """Task groups of 1-4 trajectories over shared states (contexts recur across tasks), ties, invalid rows."""
    rng = np.random.default_rng(seed)
    labels = {"go a": "NAV", "Go  A": "NAV", "go b": "SEARCH", "take x": "TAKE", "look": "LOOK"}
    rows, traj = [], 100 * seed
    for uid in range(8):
        for _ in range(int(rng.integers(1, 5))):
            length = int(rng.integers(1, 5))
            for t in range(length):
                state = int(rng.integers(0, 3))
                action = str(rng.choice(list(labels)))
                reward = float(rng.choice([0.0, 1.0])) if t == length - 1 else 0.0
                rows.append(row(uid + 10 * seed, traj, reward, f"task{uid % 3} state{state}", action, f"role{state}",
                                labels[action], f"fam|task{uid % 3} state{state}", valid=bool(rng.random() > 0.15),
                                shareable=bool(rng.random() > 0.1)))  # fmt: skip
            traj += 1
    return rows


def run_updates(seeds=(1, 2, 3), updates=(0, 1, 3), order=None) -> tuple[list[np.ndarray], BLPOMemory]:
    """Three chained updates; ``order`` permutes each batch's trajectories (a function of the seed)."""
    memory, advs = None, []
    for seed, update in zip(seeds, updates):
        rows = random_rows(seed)
        perm = np.arange(len(rows)) if order is None else order(rows)
        result = blpo_advantage(blpo_batch([rows[i] for i in perm], update_index=update), BLPOParams(), memory)
        adv = np.empty(len(rows))
        adv[perm] = result.adv
        advs.append(adv)
        memory = result.state
    return advs, memory


def test_trajectory_order_does_not_matter():
    def reversed_trajectories(rows):
        starts = [n for n in range(len(rows)) if n == 0 or rows[n]["traj"] != rows[n - 1]["traj"]] + [len(rows)]
        blocks = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
        return np.array([n for block in blocks[::-1] for n in block])

    base_adv, base_memory = run_updates()
    perm_adv, perm_memory = run_updates(order=reversed_trajectories)
    assert max(np.abs(a).max() for a in base_adv) > 0.5  # the batches do carry signal
    for a, b in zip(base_adv, perm_adv):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    for x, y in zip(base_memory.records(), perm_memory.records()):
        assert x["role"] == y["role"] and x["action"] == y["action"] and x["n_children"] == y["n_children"]
        assert [x[f] for f in "WSQR"] == pytest.approx([y[f] for f in "WSQR"], abs=1e-12)


def test_bit_identical_across_processes():
    """Two interpreters with different string-hash seeds give the same bits (no dependence on hash())."""
    script = (
        "import hashlib, json, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
        "import test_blpo as t\n"
        "advs, memory = t.run_updates()\n"
        "digest = hashlib.sha256(b''.join(a.tobytes() for a in advs))\n"
        "digest.update(json.dumps(memory.to_json_dict()).encode())\n"
        "print(digest.hexdigest())\n"
    )
    here, root = str(Path(__file__).parent), str(Path(__file__).parent.parent)
    digests = {
        subprocess.run([sys.executable, "-c", script, here, root], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }  # fmt: skip
    advs, memory = run_updates()
    local = hashlib.sha256(b"".join(a.tobytes() for a in advs))
    local.update(json.dumps(memory.to_json_dict()).encode())
    assert digests == {local.hexdigest()}


def plain_with_effects(memory: BLPOMemory, update: int, keys, sums, children) -> dict:
    """The memory write as a plain loop over keys on ``MomentRecord``s (the reference of ``with_effects``)."""
    records = dict(memory.items())
    hashes, weights, bounds = children
    for key, w, s, q, r, lo, hi in zip(keys, *sums, bounds[:-1], bounds[1:]):
        added = dict(zip(hashes[lo:hi], weights[lo:hi]))
        old = records.get(key)
        if old is None:
            records[key] = MomentRecord(w, s, q, r, update, added)
            continue
        base = old.decayed(update, memory.decay)
        for child in base.children.keys() & added.keys():
            added[child] += base.children[child]
        merged = {c: {**base.children, **added}[c] for c in sorted({**base.children, **added})}
        records[key] = MomentRecord(base.W + w, base.S + s, base.Q + q, base.R + r, update, merged)
    return records


def random_memory(rng: np.random.Generator) -> tuple[BLPOMemory, list[str]]:
    """Records over 6 roles x 4 actions (some missing) with children from 10 contexts: weights that decay
    below eps or 1e-10, roles with one action, tied scores, last updates 0..5."""
    pool = context_hashes([f"ctx{i}" for i in range(10)])
    records = {}
    for role in range(6):
        tied = rng.random() < 0.2
        for action in range(4):
            if rng.random() < 0.3:
                continue
            W = float(rng.choice([1e-7, 1e-3, rng.uniform(0.5, 5.0)]))
            S = 0.3 * W if tied else float(rng.normal()) * W
            n_child = int(rng.integers(0, 5))
            children = {pool[c]: float(rng.choice([1e-9, 1.0, rng.uniform(0.1, 3.0)]))
                        for c in rng.choice(10, n_child, replace=False)}  # fmt: skip
            records[(f"r{role}", f"a{action}")] = MomentRecord(
                W,
                S,
                S * S / W + float(rng.uniform(0, 2)),
                W * float(rng.uniform(0.2, 1.0)),
                int(rng.integers(0, 6)),
                children,
            )
    return BLPOMemory(8.0, records), pool


@pytest.mark.parametrize("seed", range(8))
def test_vectorised_memory_write_and_read_equal_the_plain_loops(seed):
    """``with_effects`` equals the plain per-key merge and ``read_progress_keys`` equals
    ``role_progress_advantage`` role by role, bit for bit, on random memories (new roles and actions,
    decay, pruning, ties, roles without records, every read setting)."""
    rng = np.random.default_rng(seed)
    memory, pool = random_memory(rng)
    update = 6 + int(rng.integers(0, 40))
    keys = [(f"r{r}", f"a{a}") for r in range(8) for a in range(5) if rng.random() < 0.4]
    w = rng.integers(1, 4, len(keys)).astype(float)
    sums = [w.tolist(), rng.normal(size=len(keys)).tolist(), rng.uniform(0, 2, len(keys)).tolist(), w.tolist()]
    hashes, weights, bounds = [], [], [0]
    for _ in keys:
        chosen = sorted(pool[c] for c in rng.choice(10, int(rng.integers(0, 4)), replace=False))
        hashes += chosen
        weights += rng.integers(1, 3, len(chosen)).astype(float).tolist()
        bounds.append(len(hashes))
    written = memory.with_effects(update, keys, sums, (hashes, weights, bounds))
    plain = BLPOMemory(8.0, plain_with_effects(memory, update, keys, sums, (hashes, weights, bounds)), update)
    assert json.dumps(written.to_json_dict()) == json.dumps(plain.to_json_dict())
    read_keys = [(f"r{r}", f"a{a}") for r in range(9) for a in range(6)]
    for settings in ({}, {"mode": "mean_norm"}, {"confidence": False, "std_floor": 0.7}, {"tau": 0.0}):
        at = update + int(rng.integers(0, 30))
        read = replace(READ, **settings)
        adv, active, score, n_active = read_progress_keys(written, KeyCodes.of(read_keys), at, read)
        reads = {r: role_progress_advantage(written.role_records(r, at, EPS), read) for r, _ in read_keys}
        expected = [(reads[r].adv.get(a, 0.0), reads[r].active and a in reads[r].score, reads[r].score.get(a, 0.0))
                    for r, a in read_keys]  # fmt: skip
        assert list(zip(adv.tolist(), active.tolist(), score.tolist())) == expected
        assert n_active == sum(read.active for read in reads.values())
