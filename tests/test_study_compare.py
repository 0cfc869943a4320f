"""The study page's statistics on hand-made outcomes: methods paired by task within a seed, McNemar's exact
test, the verdict that needs every seed and the pool, the power figure and the claims' verdicts."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from horizonrl.tracking import study_compare as sc


def _finals(won: dict[tuple[int, str], list[int]]) -> pd.DataFrame:
    rows = [
        {"seed": seed, "method": method, "task": f"t{k}", "won": w}
        for (seed, method), values in won.items()
        for k, w in enumerate(values)
    ]
    return pd.DataFrame(rows)


def test_mcnemar_exact_p_values():
    assert sc.mcnemar_p(0, 5) == pytest.approx(2 / 32)  # P(X <= 0) = 1/32 for Bin(5, 1/2), two-sided
    assert sc.mcnemar_p(1, 9) == pytest.approx(2 * 11 / 1024)  # (1 + 10) / 2^10
    assert sc.mcnemar_p(3, 3) == 1.0 and sc.mcnemar_p(0, 0) == 1.0


def test_a_seed_s_pair_is_the_mean_per_task_difference():
    finals = _finals({(0, "loop"): [1, 1, 1, 0], (0, "grpo"): [0, 0, 1, 1]})
    p = sc.seed_pair(finals, 0, "loop", "grpo")
    assert (p.change.mean, p.tasks, p.a_only, p.b_only) == (pytest.approx(0.25), 4, 2, 1)
    assert p.sd == pytest.approx(pd.Series([1, 1, 0, -1]).std(ddof=1))
    assert p.change.low <= 0.25 <= p.change.high
    assert sc.seed_pair(finals, 1, "loop", "grpo") is None


def test_a_pair_is_told_apart_only_when_every_seed_and_the_pool_agree():
    clear = [1] * 30 + [0] * 10
    worse = [0] * 30 + [0] * 10
    agree = sc.pairs(
        _finals({(0, "loop"): clear, (0, "grpo"): worse, (1, "loop"): clear, (1, "grpo"): worse}), ["loop", "grpo"]
    )
    assert [p.verdict for p in agree] == ["loop > grpo"]
    assert agree[0].pooled.mean == pytest.approx(0.75) and agree[0].pooled_tasks == 80
    assert agree[0].seed_spread == 0.0
    split = sc.pairs(
        _finals({(0, "loop"): clear, (0, "grpo"): worse, (1, "loop"): worse, (1, "grpo"): clear}), ["loop", "grpo"]
    )
    assert split[0].verdict == "not told apart" and split[0].seed_spread == pytest.approx(1.5)
    reverse = sc.pairs(_finals({(0, "loop"): worse, (0, "grpo"): clear}), ["loop", "grpo"])
    assert reverse[0].verdict == "grpo > loop"
    assert sc.claim_verdict(agree, "loop", "grpo")[0] == "agrees"
    assert sc.claim_verdict(reverse, "loop", "grpo")[0] == "disagrees"
    assert sc.claim_verdict(split, "loop", "grpo")[0] == "not told apart at this size"
    assert sc.claim_verdict(agree, "appo", "grpo") == ("not measured", None)


def test_the_detectable_difference_follows_the_normal_approximation():
    assert sc.detectable(1.0, 100) == pytest.approx((1.959964 + 0.841621) / 10, abs=1e-6)
    finals = _finals({(0, "a"): [1, 0] * 50, (0, "b"): [0, 1] * 25 + [1, 1] * 25})
    one_seed, pooled, n_seed, n_pooled = sc.power(sc.pairs(finals, ["a", "b"]))
    sd = pd.Series([1, -1] * 25 + [0, -1] * 25).std(ddof=1)
    assert (n_seed, n_pooled) == (100, 100) and one_seed == pytest.approx(sc.detectable(sd, 100))
    assert math.isnan(sc.power([])[0])


def test_finals_are_the_last_evaluation_of_finished_cells():
    outcomes = pd.DataFrame(
        [
            {"seed": 0, "method": "loop", "iteration": 0, "task": "t0", "won": 0, "turns": 5},
            {"seed": 0, "method": "loop", "iteration": 40, "task": "t0", "won": 1, "turns": 3},
            {"seed": 0, "method": "grpo", "iteration": 20, "task": "t0", "won": 1, "turns": 3},
        ]
    )
    cells = pd.DataFrame(
        [{"seed": 0, "method": "loop", "status": "FINISHED"}, {"seed": 0, "method": "grpo", "status": "RUNNING"}]
    )
    finals = sc.finished_finals(outcomes, cells)
    assert finals.to_dict("records") == [{"seed": 0, "method": "loop", "task": "t0", "won": 1.0}]


def test_the_committed_study_page_is_what_its_committed_record_gives():
    """docs/results-study-smollm2.md is generated from docs/study-smollm2/ alone (no MLflow store): regenerated
    here, it is the committed page, and each pair's per-seed paired mean recomputed with plain pandas from
    outcomes.csv is the one on the page."""
    from pathlib import Path

    from horizonrl.config.sweep import load_sweep
    from horizonrl.tracking import study_page, study_record

    root = Path(__file__).parents[1]
    sweep, record, out = "configs/sweeps/study_smollm2.yaml", "docs/study-smollm2", "docs/results-study-smollm2.md"
    spec, _ = load_sweep(root / sweep)
    outcomes, progress, cells = study_record.load(root / record)
    meta = study_page.meta(spec.name, sweep, record, out, spec.tuning)
    text = study_page.page(outcomes, progress, cells, meta, study_page.figure_names(Path(out)))
    assert text == (root / out).read_text()
    finished = cells[(cells["status"] == "FINISHED") & (cells["method"] != "warmstart")]
    for seed, group in finished.groupby("seed"):
        o = outcomes[outcomes["seed"] == seed]
        last = o[o["iteration"] == o.groupby("method")["iteration"].transform("max")]
        won = last[last["method"].isin(group["method"])].pivot_table(index="task", columns="method", values="won")
        for a, b in zip(group["method"], group["method"][1:]):
            diff = 100 * (won[a] - won[b]).dropna().mean() + 0.0
            assert f"{diff:+.1f} [" in text, (seed, a, b)


def test_a_cell_the_sweep_will_run_or_resume_is_not_shown_as_failed():
    from horizonrl.tracking.study_page import _state

    assert _state("FINISHED", 40) == "finished"
    assert _state("RUNNING", 15) == _state("FAILED", 15) == "in progress (resumes after iteration 15)"
    assert _state("FAILED", 0).startswith("to run (its start failed") and _state("NOT STARTED", 0) == "to run"


def test_a_cell_started_but_before_its_first_iteration_shows_no_number_it_lacks():
    """A cell whose only record is the starting evaluation another cell played (no environment step logged
    yet) costs 0 minutes of its own and shows a blank, not 'nan', for its steps."""
    from horizonrl.tracking.study_page import _cost_lines, cost

    progress = pd.DataFrame(
        [
            {
                "seed": 0,
                "method": "grpo",
                "iteration": 0,
                "env_steps": float("nan"),
                "iteration_s": float("nan"),
                "eval_s": 0.4,
            }
        ]
    )
    cells = pd.DataFrame(
        [{"seed": 0, "method": "grpo", "status": "RUNNING", "iterations": 0, "run_name": "b", "eval0_played_by": "a"}]
    )
    [line] = _cost_lines(cost(progress, cells), cells)[2:]
    assert line == "| 0 | grpo | to run | 0 |  | 0 | 0 | 0 |", line


def test_a_cell_whose_start_differs_from_its_seed_s_is_named_on_the_page():
    """Cells of one seed share a warm start, so their starting evaluations are the same episodes; a warm start
    trained again (a new machine) that came out different shows as tasks that differ, and the page says so."""
    from horizonrl.tracking.study_page import _start_line

    rows = [(m, t, w, n) for m in ("loop", "grpo") for t, w, n in (("t0", 1, 3), ("t1", 0, 6))]
    rows += [("blpo", "t0", 1, 3), ("blpo", "t1", 0, 5), ("loop", "t0", 0, 6)]
    outcomes = pd.DataFrame(
        [
            {"seed": 0, "method": m, "iteration": 40 if i == 6 else 0, "task": t, "won": w, "turns": n}
            for i, (m, t, w, n) in enumerate(rows)
        ]
    )
    cells = pd.DataFrame({"seed": [0] * 4, "method": ["loop", "grpo", "blpo", "warmstart"]})
    found = sc.starts(outcomes, cells)
    assert [(s.method, s.first, s.tasks, s.differ) for s in found] == [("grpo", "loop", 2, 0), ("blpo", "loop", 2, 1)]
    line = _start_line(found)
    assert "seed 0, grpo as loop on 2 tasks" in line
    assert "**seed 0: blpo started from other weights than loop** (their starting evaluations differ on 1 of 2" in line
    assert _start_line([]).startswith("Starting evaluations: no seed")
