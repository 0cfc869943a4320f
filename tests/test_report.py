"""The sweep report's arithmetic on hand-derived vectors (horizonrl.report is pure: histories in, figures out)."""

from __future__ import annotations

import math

import pytest

from horizonrl import report
from horizonrl.report import CellHistory

T_975 = {1: 12.706204736174704, 2: 4.302652729749464}  # Student t quantiles 0.975 (df 1, 2), from tables

# variant a, seed 0: evaluated at iterations 0, 2, 4; 4 episodes per iteration of 2, 3, 1, 2 turns
A0 = CellHistory("a", 0, {0: 0.0, 2: 0.5, 4: 0.5}, {1: 4, 2: 4, 3: 4, 4: 4}, {1: 2, 2: 3, 3: 1, 4: 2}, {1: 10, 2: 10, 3: 10, 4: 10}, 8.0)
# variant a, seed 1: 1 turn per episode, 5 tokens per episode
A1 = CellHistory("a", 1, {0: 0.25, 2: 0.25, 4: 1.0}, {1: 4, 2: 4, 3: 4, 4: 4}, {1: 1, 2: 1, 3: 1, 4: 1}, {1: 5, 2: 5, 3: 5, 4: 5}, 12.0)
B0 = CellHistory("b", 0, {0: 0.1}, {}, {}, {}, 1.0)


def test_seed_figures():
    f = report.seed_figures(A0)
    # AUC: trapezoids (0 + .5)/2 * 2 + (.5 + .5)/2 * 2 = 1.5 over 4 iterations
    assert f == {"final": 0.5, "best": 0.5, "auc": pytest.approx(0.375), "tokens": 160.0, "train_s": 8.0}
    assert report.seed_figures(A1)["auc"] == pytest.approx((0.5 + 1.25) / 4)
    assert report.seed_figures(B0)["auc"] == 0.1  # one evaluation: the curve's height


def test_summary_means_and_t_intervals():
    a, b = report.summarize([A0, A1, B0])
    assert (a.variant, a.seeds, b.variant, b.seeds) == ("a", 2, "b", 1)
    # final [0.5, 1.0]: mean 0.75, s = 0.5 / sqrt 2, half = t(1) * s / sqrt 2 = t(1) * 0.25
    assert a.final.mean == pytest.approx(0.75) and a.final.half == pytest.approx(T_975[1] * 0.25, rel=1e-12)
    assert a.best == a.final
    # auc [0.375, 0.4375]: half = t(1) * |diff| / 2
    assert a.auc.mean == pytest.approx(0.40625) and a.auc.half == pytest.approx(T_975[1] * 0.0625 / 2, rel=1e-12)
    assert (a.tokens, a.train_s) == (120.0, 10.0)
    assert b.final.mean == 0.1 and math.isnan(b.final.half)  # one seed: no interval


def test_interval_three_seeds():
    ci = report.interval([0.1, 0.2, 0.6])  # s^2 = (.04 + .01 + .09) / 2 = .07
    assert ci.mean == pytest.approx(0.3) and ci.half == pytest.approx(T_975[2] * math.sqrt(0.07) / math.sqrt(3), rel=1e-12)


def test_summary_does_not_depend_on_seed_order():
    assert report.summarize([A1, A0]) == report.summarize([A0, A1])


def test_curves_against_iterations_and_env_steps():
    a, b = report.curves([A0, A1, B0])
    assert a.iterations == [0, 2, 4]
    assert a.mean == pytest.approx([0.125, 0.375, 0.75])
    # cumulative steps: seed 0 after iteration 2: 4*2 + 4*3 = 20, after 4: 32; seed 1: 8 and 16
    assert a.env_steps == pytest.approx([0.0, 14.0, 24.0])
    assert a.half[0] == pytest.approx(T_975[1] * 0.125 / 1, rel=1e-12)  # [0, .25]: s = .25/sqrt2, half = t * .125
    assert (b.iterations, b.env_steps) == ([0], [0.0])


def test_table_markdown_and_plots(tmp_path):
    summaries = report.summarize([A0, A1, B0])
    rows = report.table(summaries)
    assert rows[0] == {"variant": "a", "seeds": 2, "final_mean": 0.75, "final_ci95": summaries[0].final.half, "best_mean": 0.75,
                       "best_ci95": summaries[0].best.half, "auc_mean": 0.40625, "auc_ci95": summaries[0].auc.half, "tokens": 120.0, "train_s": 10.0}
    md = report.markdown("Sweep t", summaries)
    assert "| a | 2 | 0.750 ± 3.177 |" in md and "| b | 1 | 0.100 ± nan |" in md
    for x in ("iterations", "env_steps"):
        fig = report.plot(report.curves([A0, A1, B0]), x)
        assert [line.get_label() for line in fig.axes[0].get_lines()] == ["a", "b"]
        fig.savefig(tmp_path / f"{x}.png")
        assert (tmp_path / f"{x}.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_without_evaluation_is_named():
    with pytest.raises(ValueError, match="variant 'c' seed 3: no eval/success_rate"):
        report.summarize([CellHistory("c", 3, {})])
