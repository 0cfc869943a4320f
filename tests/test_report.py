"""The report's arithmetic on hand-derived vectors (horizonrl.tracking.report is pure: histories in, figures out), and
the results page generated from a stored fixture of metric histories: the same page and figures twice, and
the numbers, warnings and claim verdicts the fixture's values were chosen to give."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from horizonrl.tracking import plots, report, results_page, stats
from horizonrl.tracking.report import CellHistory

FIXTURE = Path(__file__).parent / "fixtures" / "report_histories.json"

# variant a, seed 0: evaluated at iterations 0, 2, 4; 4 episodes per iteration of 2, 3, 1, 2 turns
A0 = CellHistory(
    "a",
    0,
    {0: 0.0, 2: 0.5, 4: 0.5},
    {1: 4, 2: 4, 3: 4, 4: 4},
    {1: 2, 2: 3, 3: 1, 4: 2},
    {1: 10, 2: 10, 3: 10, 4: 10},
    8.0,
)
# variant a, seed 1: 1 turn per episode, 5 tokens per episode
A1 = CellHistory(
    "a",
    1,
    {0: 0.25, 2: 0.25, 4: 1.0},
    {1: 4, 2: 4, 3: 4, 4: 4},
    {1: 1, 2: 1, 3: 1, 4: 1},
    {1: 5, 2: 5, 3: 5, 4: 5},
    12.0,
)
B0 = CellHistory("b", 0, {0: 0.1}, {}, {}, {}, 1.0)


def _fixture() -> list[CellHistory]:
    def keyed(d: dict) -> dict:
        return {int(k): v for k, v in d.items()}

    return [
        CellHistory(
            c["variant"],
            c["seed"],
            keyed(c["success"]),
            keyed(c["episodes"]),
            keyed(c["mean_turns"]),
            keyed(c["tokens_per_episode"]),
            c["train_s"],
            keyed(c["env_steps"]),
            keyed(c["wall_s"]),
            {f: keyed(h) for f, h in c.get("families", {}).items()},
            keyed(c.get("eval_episodes", {})),
        )
        for c in json.loads(FIXTURE.read_text())["cells"]
    ]


CTX = results_page.PageContext(
    "Results: fixture",
    ["0123abcd"],
    ["configs/sweeps/x.yaml", "configs/x.yaml"],
    "horizonrl report configs/sweeps/x.yaml --out docs/results.md",
    "sqlite:///mlflow/mlflow.db",
    "parent-id",
    results_page.WarmStart("models:/ws/1", "ws-run", 0.3, 200),
)
FIGURES = {x: f"results_{x}.png" for x in report.X_AXES}


def test_seed_figures():
    f = report.seed_figures(A0)
    # AUC: trapezoids (0 + .5)/2 * 2 + (.5 + .5)/2 * 2 = 1.5 over 4 iterations; env steps 8 + 12 + 4 + 8
    assert f == {
        "final": 0.5,
        "best": 0.5,
        "auc": pytest.approx(0.375),
        "change": 0.5,
        "tokens": 160.0,
        "train_s": 8.0,
        "env_steps": 32.0,
    }
    assert report.seed_figures(A1)["change"] == 0.75  # 1.0 at the end, 0.25 at its first evaluation
    assert report.seed_figures(A1)["auc"] == pytest.approx((0.5 + 1.25) / 4)
    assert report.seed_figures(B0)["auc"] == 0.1  # one evaluation: the curve's height


def test_bootstrap_interval_of_two_or_three_seeds_is_their_range():
    # every resample's mean lies in [min, max], and the extremes (all-min, all-max) have probability
    # 1/4 (2 seeds) or 1/27 (3 seeds), both above 2.5%: the percentiles are the extremes
    assert stats.interval([0.5, 1.0]) == stats.Interval(0.75, 0.5, 1.0)
    ci = stats.interval([0.1, 0.2, 0.6])
    assert (ci.mean, ci.low, ci.high) == (
        pytest.approx(0.3),
        pytest.approx(0.1, abs=1e-15),
        pytest.approx(0.6, abs=1e-15),
    )
    assert math.isnan(stats.interval([0.4]).low) and stats.interval([0.4]).mean == 0.4


def test_bootstrap_interval_stays_inside_zero_one_and_is_fixed():
    values = [0.0, 0.0, 0.05, 0.9, 1.0, 1.0]
    ci = stats.interval(values)
    assert 0.0 <= ci.low < ci.mean < ci.high <= 1.0
    assert stats.interval(values) == ci, "the bootstrap draws from a fixed generator"
    se = np.std(values, ddof=1) / math.sqrt(len(values))
    assert ci.high - ci.low == pytest.approx(2 * 1.96 * se, rel=0.25)  # near the normal interval's width


def test_newcombe_interval_of_a_difference():
    # Newcombe (1998), Stat. Med. 17:873, Table II example (a): 56/70 - 48/80, method 10: 0.0524 to 0.3339
    d = stats.newcombe(48 / 80, 80, 56 / 70, 70)
    assert (d.mean, round(d.low, 4), round(d.high, 4)) == (pytest.approx(0.2), 0.0524, 0.3339)
    # pooled over seeds: loop's three seeds, 200 episodes at each end (by hand: +0.350 [+0.298, +0.400])
    loop = [c for c in _fixture() if c.variant == "loop"]
    p = report.pooled_change(loop)
    assert (p.first_episodes, p.final_episodes) == (600, 600) and p.change.mean == pytest.approx(0.55 - 0.2)
    assert p.change == stats.newcombe(0.2, 600, 0.55, 600)
    assert (
        report.pooled_change([replace(loop[0], eval_episodes={0: 200})]) is None
    )  # the last evaluation's count is missing


def test_wilson_interval():
    low, high = stats.wilson(0.3, 200)  # 60 / 200: [0.2407, 0.3668] (Wilson's formula, by hand)
    assert (low, high) == (pytest.approx(0.24075, abs=1e-4), pytest.approx(0.36680, abs=1e-4))
    assert stats.wilson(0.0, 10)[0] == 0.0 and stats.wilson(1.0, 10)[1] == pytest.approx(1.0, abs=1e-12)


def test_summary_does_not_depend_on_seed_order():
    assert report.summarize([A1, A0]) == report.summarize([A0, A1])


def test_curves_against_iterations_env_steps_and_wall_time():
    a, b = report.curves([A0, A1, B0])
    assert a.iterations == [0, 2, 4]
    assert a.mean == pytest.approx([0.125, 0.375, 0.75])
    # cumulative steps: seed 0 after iteration 2: 4*2 + 4*3 = 20, after 4: 32; seed 1: 8 and 16
    assert a.env_steps == pytest.approx([0.0, 14.0, 24.0])
    assert (a.low[0], a.high[0]) == (0.0, 0.25)
    assert [s["success"] for s in a.seeds] == [[0.0, 0.5, 0.5], [0.25, 0.25, 1.0]]
    assert (b.iterations, b.env_steps) == ([0], [0.0])


def test_fixture_numbers():
    by = {s.variant: s for s in report.summarize(_fixture())}
    loop = by["loop"]
    assert (loop.seeds, loop.final.mean, loop.final.low, loop.final.high) == (
        3,
        pytest.approx(0.55),
        pytest.approx(0.5),
        pytest.approx(0.6),
    )
    # seed 0's curve: 0.2, 0.35, 0.5 at 0, 5, 10 -> AUC (0.275 * 5 + 0.425 * 5) / 10 = 0.35; seeds 1, 2: +0.01, +0.02 at
    # 5
    assert loop.auc.mean == pytest.approx(
        np.mean([0.35, (0.2 + 0.41) / 4 + (0.41 + 0.6) / 4, (0.2 + 0.395) / 4 + (0.395 + 0.55) / 4])
    )
    assert loop.env_steps == 1000.0 and by["appo"].env_steps == 1500.0  # APPO's branches count
    assert loop.tokens == 10 * 16 * 20.0 and loop.train_s == 101.0
    assert by["appo"].seeds == 2 and (by["appo"].final.low, by["appo"].final.high) == (
        pytest.approx(0.2),
        pytest.approx(0.3),
    )
    # change from the first evaluation: loop's seeds 0.3, 0.4, 0.35 above it; grpo's final under its start
    assert (loop.change.mean, loop.change.low, loop.change.high) == (
        pytest.approx(0.35),
        pytest.approx(0.3),
        pytest.approx(0.4),
    )
    assert report.improvement(loop) == "improves" and report.improvement(by["grpo"]) == "no change told apart"
    assert (
        report.improvement(
            report.summarize([CellHistory("w", s, {0: 0.5, 4: 0.5 - d}) for s, d in enumerate((0.1, 0.2, 0.15))])[0]
        )
        == "worsens"
    )
    assert report.improvement(report.summarize([B0])[0]) == "no change told apart"  # one seed: no interval


def test_claim_verdicts():
    summaries = report.summarize(_fixture())
    verdicts = {c.text: report.judge(c, summaries) for c in report.CLAIMS}
    assert list(verdicts.values()) == [
        "cannot be told apart",  # token > turn holds, turn vs trajectory overlap
        "does not hold",  # with std normalisation [0.62, 0.70] lies above loop [0.5, 0.6]
        "holds",  # blpo [0.4, 0.5] > gigpo [0.3, 0.35] > grpo [0.1, 0.2]
        "cannot be told apart",
    ]  # appo [0.2, 0.3] touches grpo [0.1, 0.2]
    assert report.judge(report.Claim("x", ["loop", "sarsa"]), summaries) == "not measured (sarsa absent)"


def test_drifts_flag_finals_outside_the_previous_interval():
    before = report.summarize(_fixture())
    moved = [
        CellHistory(c.variant, c.seed, {**c.success, 10: c.success[10] + (0.3 if c.variant == "grpo" else 0.0)})
        for c in _fixture()
    ]
    found = report.drifts(report.summarize(moved), before)
    assert [(d.variant, d.now) for d in found] == [("grpo", pytest.approx(0.45))]
    assert report.drifts(before, before) == []


def test_results_page_is_deterministic_and_complete(tmp_path):
    cells = _fixture()
    page = results_page.results_page(cells, CTX, FIGURES)
    assert results_page.results_page(list(reversed(cells)), CTX, FIGURES) == page, "cell order changed the page"
    assert "| warm start (`models:/ws/1`) | 1 | 0.300 [0.241, 0.367] |" in page
    assert "| loop | 3 | 0.550 [0.500, 0.600] |" in page
    assert "| appo | 2 | 0.250 [0.200, 0.300] |" in page and "⚠ 2 seeds: too few to separate methods" in page
    assert page.count("too few to separate methods") == 1
    assert "These seeds order 17 of the 28 pairs" in page and "; loop > loop loss_params.ratio_level=turn;" in page
    assert "turn > loop loss_params.ratio_level=trajectory" not in page  # their intervals overlap
    for name in FIGURES.values():
        assert f"]({name})" in page
    assert "thin lines are single seeds" in page and "95% percentile-bootstrap interval of the mean over seeds" in page
    assert (
        "- BLPO > GiGPO > GRPO on long-horizon household tasks: **holds** (blpo 0.450 [0.400, 0.500] > gigpo 0.323 "
        "[0.300, 0.350] > grpo 0.150 [0.100, 0.200])" in page
    )
    assert "`0123abcd`" in page and "configs/sweeps/x.yaml" in page and CTX.command in page
    assert f"- cells: {len(cells)} finished, every cell of the sweep" in page
    assert "## What was tuned\n\nThe sweep file does not say" in page
    told = results_page.results_page(cells, replace(CTX, tuning="Only the\n  learning rate, on LOOP."), FIGURES)
    assert "## What was tuned\n\nOnly the learning rate, on LOOP.\n" in told
    assert (
        "| loop | 3 | 0.550 [0.500, 0.600] | 0.550 [0.500, 0.600] | 0.380 [0.350, 0.405] | +0.350 [+0.300, +0.400] |"
        in page
    )
    assert (
        "- loop: **improves** (+0.350 [+0.300, +0.400] over seeds; +0.350 [+0.298, +0.400] pooled over 600 and 600 "
        "episodes)" in page
    )
    assert "- grpo: **no change told apart** (-0.050 [-0.100, +0.000] over seeds; no episode counts to pool)" in page
    # gigpo's seeds agree (+0.123 [+0.100, +0.150]) but its 60 + 60 episodes do not tell the change from none
    assert (
        "- gigpo: **no change told apart** (+0.123 [+0.100, +0.150] over seeds; +0.123 [-0.034, +0.273] pooled over "
        "60 and 60 episodes)" in page
    )
    assert (
        "above no change: blpo, loop, loop advantage_params.normalize_std=True, loop loss_params.ratio_level=turn."
        in page
    )
    # by task family: each seed's last evaluation; grpo logged only pick_two, and on one seed (no interval)
    assert "| variant | pick_and_place | pick_two |" in page
    assert "| loop | 0.750 [0.700, 0.800] | 0.350 [0.300, 0.400] |" in page
    assert "| grpo |  | 0.050 |" in page and "| blpo |  |  |" in page
    one_method = results_page.results_page([CellHistory("w", 0, {0: 0.5})], CTX, FIGURES)
    assert one_method.count("By task family") == 0
    assert "## The papers' claims" not in one_method, "a sweep of one variant tests no claim"
    assert page.count("## The papers' claims at this scale") == 1

    images = []
    for attempt in range(2):
        out = tmp_path / str(attempt)
        out.mkdir()
        for x, name in FIGURES.items():
            fig = plots.plot(report.curves(cells), x)
            fig.savefig(out / name, metadata={"Software": None})
        images.append({name: (out / name).read_bytes() for name in FIGURES.values()})
    assert images[0] == images[1] and all(b[:4] == b"\x89PNG" for b in images[0].values())


def test_plot_draws_each_seed_thin_under_the_mean_with_integer_ticks():
    cells = _fixture()
    fig = plots.plot(report.curves(cells), "iterations")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    variants = sorted({c.variant for c in cells})
    assert [ax.get_title().replace("\n", " ") for ax in panels] == variants  # one panel per variant
    for ax, variant in zip(panels, variants):
        lines = ax.get_lines()
        seeds = [line for line in lines if line.get_label() == "_seed"]
        (mean,) = [line for line in lines if line.get_label() == variant]
        assert len(seeds) == sum(c.variant == variant for c in cells)
        assert len([line for line in lines if line.get_label() == "_context"]) == len(variants) - 1
        assert max(line.get_linewidth() for line in seeds) < mean.get_linewidth()
        assert all(t == int(t) for t in ax.get_xticks())
    low, high = panels[0].get_ylim()  # the data span 0.1 to 0.7: the axis fits them, inside [0, 1]
    assert 0.0 <= low <= 0.1 and 0.7 <= high <= 1.0 and high - low < 0.8


def test_a_run_without_evaluation_is_named():
    with pytest.raises(ValueError, match="variant 'c' seed 3: no eval/success_rate"):
        report.summarize([CellHistory("c", 3, {})])


def test_paired_difference_pairs_iterations_inside_the_window():
    """Only iterations both runs have, inside first..last, are paired; the interval is the bootstrap of those
    differences."""
    control = {1: 0.20, 2: 0.30, 3: 0.10, 5: 0.40}
    run = {1: 0.25, 2: 0.25, 3: 0.20, 4: 0.90, 5: 0.50}
    diff, n = stats.paired_difference(control, run, 1, 4)
    assert n == 3 and diff.mean == pytest.approx((0.05 - 0.05 + 0.10) / 3)
    assert diff == stats.interval([run[i] - control[i] for i in (1, 2, 3)])
    assert diff.low < diff.mean < diff.high and diff.low >= -0.05 - 1e-12 and diff.high <= 0.10 + 1e-12
    assert stats.paired_difference(control, run, 4, 4)[1] == 0


def test_the_page_says_what_code_differs_between_the_commits_the_cells_ran_at():
    one = results_page.results_page(_fixture(), CTX, FIGURES)
    assert "- commit: `0123abcd`" in one and "differ between" not in one
    lines = {
        changes: results_page.results_page(
            _fixture(),
            replace(CTX, commits=["0123abcd", "4567ef01"], code_changes=None if changes is None else list(changes)),
            FIGURES,
        )
        for changes in (None, (), ("methods/loop.py",))
    }
    for page in lines.values():
        assert "- commits: the cells ran at 2 commits: `0123abcd`, `4567ef01`" in page
    assert "differ between those commits: not compared" in lines[None]
    assert "differ between those commits: none (only documentation" in lines[()]
    assert "differ between those commits: `methods/loop.py`" in lines[("methods/loop.py",)]


def test_every_variant_a_claim_names_is_a_cell_of_the_shipped_study():
    """The claims are judged on the variants the study's cells make; a label in another key order would
    leave a claim "not measured" with every cell finished."""
    from horizonrl.config.sweep import load_sweep

    _, cells = load_sweep(str(Path(__file__).parents[1] / "configs" / "sweeps" / "study_household_medium.yaml"))
    variants = {report.variant_name(cell.coords) for cell in cells}
    assert {v for claim in report.CLAIMS for v in claim.order} <= variants, variants
    assert (
        report.variant_name({"seed": 0, "method": "loop", "loss_params.ratio_level": "turn"})
        == "loop loss_params.ratio_level=turn"
    )
    assert report.variant_name({"seed": 1}) == "base"


def test_two_variants_are_ordered_only_when_the_pooled_episodes_agree_with_the_seeds():
    by = {s.variant: s for s in report.summarize(_fixture())}
    gigpo, grpo = by["gigpo"], by["grpo"]  # final 0.323 [0.300, 0.350] and 0.150 [0.100, 0.200]: disjoint over seeds
    assert gigpo.pooled_final == report.Pooled(pytest.approx(19.4 / 60), 60) and grpo.pooled_final is None
    assert (
        report.compare(gigpo, grpo) == "above" and report.compare(grpo, gigpo) == "below"
    )  # grpo has no episode counts
    few, many = (
        replace(grpo, pooled_final=report.Pooled(0.15, 20)),
        replace(grpo, pooled_final=report.Pooled(0.15, 2000)),
    )
    assert (
        report.compare(replace(gigpo, pooled_final=report.Pooled(0.323, 20)), few) == "overlap"
    )  # 20 + 20 episodes: -0.092 to +0.412
    assert report.compare(replace(gigpo, pooled_final=report.Pooled(0.323, 2000)), many) == "above"
    blpo_first = replace(by["blpo"], pooled_final=report.Pooled(0.45, 20))
    assert (
        report.judge(report.CLAIMS[2], [blpo_first, replace(gigpo, pooled_final=report.Pooled(0.323, 20)), grpo])
        == "cannot be told apart"
    )


def test_the_starting_policy_as_the_cells_evaluated_it_counts_each_seed_once():
    cells = [replace(c, eval_episodes={min(c.success): 100, max(c.success): 100}) for c in _fixture()]
    start, seeds = report.cells_start(cells)  # every cell starts at 0.2; seeds 0, 1, 2
    assert (start, seeds) == (report.Pooled(pytest.approx(0.2), 300), 3)
    low, high = stats.wilson(0.2, 300)
    assert (
        f"| the same, as the cells first evaluated it | 3 | 0.200 [{low:.3f}, {high:.3f}] |"
        in results_page.results_page(cells, CTX, FIGURES)
    )
    own = results_page.results_page(cells, replace(CTX, warm_start=None), FIGURES)  # each seed warm-started alone
    assert f"| starting policies | 3 | 0.200 [{low:.3f}, {high:.3f}] |" in own and "the warm start:" not in own
    other = replace(cells[0], success={**cells[0].success, 0: 0.25})  # one cell of seed 0 started elsewhere
    assert report.cells_start([other, *cells[1:]]) is None and report.cells_start(_fixture()) is None  # no counts


def test_paired_change_is_the_mean_of_each_shared_tasks_difference():
    """Per task, mean success after minus before over its samples: a 0/0 -> 1/1 (+1), b 1 -> 1 (0), c 0/1 -> 1/0
    (0); d only after and e only before are left out: mean (1 + 0 + 0) / 3 on 3 tasks, the interval the bootstrap
    of those differences in key order, whatever order the dicts were built in."""
    before = {"e": [1.0], "c": [0.0, 1.0], "b": [1.0], "a": [0.0, 0.0]}
    after = {"a": [1.0, 1.0], "b": [1.0], "c": [1.0, 0.0], "d": [1.0]}
    change, n = stats.paired_change(before, after)
    assert n == 3 and change.mean == pytest.approx(1 / 3)
    assert change == stats.interval([1.0, 0.0, 0.0])
    assert stats.paired_change(dict(reversed(before.items())), dict(reversed(after.items()))) == (change, n)
    none, zero = stats.paired_change({"a": [1.0]}, {"b": [1.0]})
    assert zero == 0 and math.isnan(none.mean)


def test_paired_interval_excludes_zero_for_a_clear_gain_and_not_for_none():
    """40 tasks: 30 go from lost to won and 10 stay lost (+0.75, far from 0); or 10 go up, 10 down and 20 stay
    (mean 0: the interval straddles it)."""
    tasks = [f"t{i:02d}" for i in range(40)]
    gain, n = stats.paired_change({t: [0.0] for t in tasks}, {t: [float(i < 30)] for i, t in enumerate(tasks)})
    assert n == 40 and gain.mean == pytest.approx(0.75) and 0.5 < gain.low < gain.mean < gain.high <= 1.0
    before = {t: [float(10 <= i < 20)] for i, t in enumerate(tasks)}
    after = {t: [float(i < 10)] for i, t in enumerate(tasks)}
    same, _ = stats.paired_change(before, after)
    assert same.mean == 0.0 and same.low < 0.0 < same.high


def _paired(mean: float, low: float, high: float, tasks: int = 500) -> report.PairedChange:
    return report.PairedChange(stats.Interval(mean, low, high), tasks)


def test_each_seeds_paired_change_is_on_the_page_with_whether_every_interval_excludes_zero():
    """Variant a: both seeds above 0; b: seed 0 includes 0, seed 1 logged none; c: one seed above, one below;
    the fixture's runs logged none: no such section (their page is the one before the paired change)."""
    cells = [
        replace(A0, paired=_paired(0.182, 0.130, 0.234)),
        replace(A1, paired=_paired(0.204, 0.151, 0.257, 498)),
        CellHistory("b", 0, {0: 0.1, 4: 0.2}, paired=_paired(0.04, -0.01, 0.09)),
        CellHistory("b", 1, {0: 0.1, 4: 0.2}),
        CellHistory("c", 0, {0: 0.1, 4: 0.2}, paired=_paired(0.1, 0.05, 0.15)),
        CellHistory("c", 1, {0: 0.1, 4: 0.0}, paired=_paired(-0.1, -0.15, -0.05)),
    ]
    page = results_page.results_page(cells, CTX, FIGURES)
    assert (
        "- a: seed 0 +18.2 points [+13.0, +23.4] on 500 paired tasks; seed 1 +20.4 points [+15.1, +25.7] on 498 "
        "paired tasks: **every seed's interval excludes 0 (all above 0)**" in page
    )
    assert (
        "- b: seed 0 +4.0 points [-1.0, +9.0] on 500 paired tasks; seed 1 not logged: **not every seed's interval "
        "excludes 0 (seed 0 includes 0, seed 1 not logged)**" in page
    )
    assert "- c: seed 0 +10.0 points" in page and "**every seed's interval excludes 0 (not all on one side)**" in page
    assert "Every seed's paired interval above 0: a.\n" in page
    ends = replace(A0, paired=replace(_paired(0.196, 0.146, 0.246), first=0.498, last=0.694))
    assert "seed 0 0.498 -> 0.694: +19.6 points [+14.6, +24.6] on 500 paired tasks" in results_page.results_page(
        [ends], CTX, FIGURES
    )
    one_task = replace(A0, paired=_paired(1.0, math.nan, math.nan, 1))
    assert "seed 0 +100.0 points on 1 paired tasks" in results_page.results_page([one_task], CTX, FIGURES)
    assert "has no interval" in results_page.results_page([one_task], CTX, FIGURES)
    fixture = results_page.results_page(_fixture(), CTX, FIGURES)
    assert "Paired by held-out task" not in fixture and "Prompted baselines" not in fixture


def test_prompted_baselines_are_a_table_in_a_fixed_order():
    """Rows sorted by model, then environment, tier, ... whatever order MLflow returned them in; an experiment
    with none, or not in the store, says so."""

    def row(model: str, prompt: str, success: float, run_id: str) -> results_page.Baseline:
        return results_page.Baseline(
            model, "household", "easy", "test", "admissible", prompt, "window", 500, 500, success, success - 0.03,
            success + 0.04, run_id,
        )  # fmt: skip

    runs = [row("smol", "listed", 0.122, "r2"), row("qwen", "listed", 0.2, "r3"), row("smol", "compact", 0.05, "r1")]
    page = results_page.results_page(
        _fixture(), replace(CTX, baselines=results_page.Baselines("baselines", runs)), FIGURES
    )
    table = page[page.index("## Prompted baselines") : page.index("## Against the starting policy")]
    assert "in MLflow experiment `baselines`" in table
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    played = "| household | easy | test | admissible |"
    assert rows == [
        f"| `qwen` {played} listed | window | 500 (500) | 0.200 [0.170, 0.240] | `r3` |",
        f"| `smol` {played} compact | window | 500 (500) | 0.050 [0.020, 0.090] | `r1` |",
        f"| `smol` {played} listed | window | 500 (500) | 0.122 [0.092, 0.162] | `r2` |",
    ]
    reordered = replace(CTX, baselines=results_page.Baselines("baselines", list(reversed(runs))))
    assert results_page.results_page(_fixture(), reordered, FIGURES) == page
    empty = replace(CTX, baselines=results_page.Baselines("baselines", []))
    assert "⚠ none." in results_page.results_page(_fixture(), empty, FIGURES)
    missing = replace(CTX, baselines=results_page.Baselines("typo", [], exists=False))
    assert "⚠ no such experiment in this store." in results_page.results_page(_fixture(), missing, FIGURES)
