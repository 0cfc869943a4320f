"""Figures over an episodes table (horizonrl/rollout/metrics.py), checked on a hand-built table."""

from __future__ import annotations

import pyarrow as pa
import pytest

from horizonrl.rollout.metrics import episode_metrics


def _episodes(**columns) -> pa.Table:
    """Six episodes in two groups of three, from two task families, plus one APPO branch (not counted)."""
    base = {
        "group_id": ["g0", "g0", "g0", "g1", "g1", "g1", "g1"],
        "kind": ["initial"] * 6 + ["branch"],
        "family": ["pick_two"] * 3 + ["pick_and_place"] * 4,
        "n_turns": [30, 12, 30, 5, 7, 9, 4],
        "episode_return": [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0],
        "won": [False, True, False, True, True, True, True],
        "n_invalid": [3, 0, 0, 0, 1, 0, 0],
        "gen_tokens": [90, 36, 90, 15, 21, 27, 12],
        "status": ["ok", "ok", "error", "ok", "ok", "ok", "ok"],
    }
    return pa.table(base | columns)


def test_figures_over_initial_rollouts_with_success_per_family():
    m = episode_metrics(_episodes())
    assert m["episodes"] == 6
    assert m["success_rate"] == pytest.approx(4 / 6)
    assert m["mean_turns"] == pytest.approx(93 / 6)
    assert m["invalid_rate"] == pytest.approx(4 / 93)
    assert m["error_rate"] == pytest.approx(1 / 6)
    assert m["mixed_group_fraction"] == 0.5  # g0 has a win and losses; g1 won every time
    assert m["pass_at_k"] == 1.0
    assert m["success_rate/pick_two"] == pytest.approx(1 / 3)
    assert m["success_rate/pick_and_place"] == 1.0  # the branch's win is not counted


def test_no_family_figures_for_tasks_without_a_family():
    m = episode_metrics(_episodes(family=[""] * 7))
    assert not [k for k in m if k.startswith("success_rate/")]
    assert m["success_rate"] == pytest.approx(4 / 6)


def test_task_outcomes_group_each_tasks_samples_by_its_id_and_seed():
    """Two samples of task 0, one of task 1; the same place in the split built from another seed is another task."""
    from horizonrl.rollout.metrics import task_outcomes

    table = pa.table(
        {
            "task_id": [
                "household/easy/test/0",
                "household/easy/test/1",
                "household/easy/test/0",
                "household/easy/test/0",
            ],
            "task_seed": [11, 12, 11, 99],
            "won": [True, False, False, True],
        }
    )
    assert task_outcomes(table) == {
        "household/easy/test/0@11": [1.0, 0.0],
        "household/easy/test/1@12": [0.0],
        "household/easy/test/0@99": [1.0],
    }
