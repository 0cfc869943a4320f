"""Sweep files (every shipped one loads; bad ones name the field), which cells count as finished (real
MLflow on SQLite), the evaluate flow's config rebuilt from a run's params, and a sweep run in process
(its cells' runs nested before they start; its page with each seed's paired change and the prompted
baselines of real ``evaluate --model`` runs). The sweep and evaluate flows run through deployments on
the real stack in test_stack.py."""

from __future__ import annotations

import math
from datetime import UTC
from pathlib import Path

import pytest
import yaml
from flowkit import tiny_config

from flows.sweep import sweep, sweep_report
from horizonrl.config import TrainConfig
from horizonrl.config.sweep import load_sweep
from horizonrl.tracking import mlflow_runs
from horizonrl.tracking.sweep_runs import BASE_TAG, INSTANCE_TAG, PREVIOUS_TAG, SWEEP_TAG, finished
from mlflow import MlflowClient
from tasks.evaluation_run import config_of_run
from tasks.sweep import artifact_key

SWEEPS = sorted((Path(__file__).parents[1] / "configs" / "sweeps").glob("*.y*ml"))


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_every_shipped_sweep_loads(path):
    spec, cells = load_sweep(path)
    assert len(cells) == sum(math.prod(len(v) for v in g.values()) for g in spec.grids())
    assert len({c.run_name for c in cells}) == len(cells)
    for cell in cells:
        for key, value in cell.coords.items():
            node = cell.config.model_dump()
            for part in key.split("."):
                node = node[part]
            assert node == value, f"{cell.run_name}: {key}"


def _write(tmp_path: Path, sweep: dict, base: dict | None = None) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base if base is not None else {"iterations": 1}))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": "base.yaml", **sweep}, sort_keys=False))
    return path


def test_cells_are_the_grid_product_with_overrides(tmp_path):
    spec, cells = load_sweep(
        _write(
            tmp_path,
            {
                "set": ["eval.n_tasks=7"],
                "grid": {"method": ["loop", "grpo"], "loss_params.ratio_level": ["token", "turn"]},
            },
        )
    )
    assert [c.run_name for c in cells] == [
        "s--method=loop--loss_params.ratio_level=token",
        "s--method=loop--loss_params.ratio_level=turn",
        "s--method=grpo--loss_params.ratio_level=token",
        "s--method=grpo--loss_params.ratio_level=turn",
    ]
    assert all(c.config.eval.n_tasks == 7 and c.config.iterations == 1 for c in cells)
    assert cells[3].config.loss_spec()[1].ratio_level == "turn" and cells[3].config.method == "grpo"
    assert spec.concurrency == 1 and spec.deployment is None


def test_a_list_of_grids_is_the_union_of_their_products(tmp_path):
    _, cells = load_sweep(
        _write(
            tmp_path,
            {
                "grid": [
                    {"method": ["loop", "grpo"], "seed": [0]},
                    {"method": ["loop"], "loss_params.ratio_level": ["turn"], "seed": [0]},
                ]
            },
        )
    )
    assert [c.run_name for c in cells] == [
        "s--method=loop--seed=0",
        "s--method=grpo--seed=0",
        "s--method=loop--loss_params.ratio_level=turn--seed=0",
    ]
    _, named = load_sweep(_write(tmp_path, {"grid": {"seed": [0]}}), instance="20260101T030000Z-abc")
    assert named[0].run_name == "s--20260101T030000Z-abc--seed=0"


@pytest.mark.parametrize(
    "sweep, message",
    [
        ({"grid": {}}, r"sweep.yaml': grid is empty: give at least one key"),
        ({"grid": {"method": []}}, "grid.method has no values"),
        (
            {"grid": {"method": ["loop", "sarsa"]}},
            r"grid cell \{'method': 'sarsa'\}: config: method is not a method; known: .* \(got 'sarsa' from --set\)",
        ),
        ({"grid": {"update.lrr": [1]}}, r"(?s)grid cell \{'update.lrr': 1\}: .*update.lrr"),
        ({"grid": {"seed": [0]}, "concurrency": 0}, "concurrency"),
        ({"grid": {"seed": [0]}, "methods": ["loop"]}, "methods"),
        ({"grid": {"experiment": ["a", "b"]}}, "grid varies 'experiment'"),
        ({"grid": [{"seed": [0]}, {"seed": [0, 1]}]}, r"repeat cells \['s--seed=0'\]"),
        ({"grid": [{"seed": [0]}, {}]}, "grid is empty"),
    ],
)
def test_bad_sweep_names_the_field(tmp_path, sweep, message):
    with pytest.raises(ValueError, match=message):
        load_sweep(_write(tmp_path, sweep))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="sweep file .*nope.yaml' does not exist"):
        load_sweep(tmp_path / "nope.yaml")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "base": "absent.yaml", "grid": {"seed": [0]}}))
    with pytest.raises(ValueError, match="config: file .*absent.yaml' does not exist"):
        load_sweep(path)


def test_finished_means_run_finished_after_all_iterations(tmp_path, tracking_uri):
    _, cells = load_sweep(_write(tmp_path, {"grid": {"seed": [0]}}, tiny_config(tmp_path, tracking_uri, iterations=2)))
    cell, c = cells[0], MlflowClient(tracking_uri)
    assert not finished(c, cell)  # no run yet
    run_id, _ = mlflow_runs.find_or_create_run(c, "test", cell.run_name, {})
    mlflow_runs.log_metrics(c, run_id, "summary", {"iterations": 1.0}, 1)
    c.set_terminated(run_id, "FINISHED")
    assert not finished(c, cell), "a run finished with fewer iterations than the cell asks for resumes"
    mlflow_runs.find_or_create_run(c, "test", cell.run_name, {})  # a resumed attempt: RUNNING again
    mlflow_runs.log_metrics(c, run_id, "summary", {"iterations": 2.0}, 2)
    assert not finished(c, cell), "a run still running (or killed) is not finished"
    c.set_terminated(run_id, "FINISHED")
    assert finished(c, cell)


def test_config_of_run_reads_the_config_the_run_logged(tmp_path, tracking_uri):
    """The evaluate flow's source config is the run's ``config.yaml`` artifact, as ``open_run`` logs it."""
    cfg = TrainConfig.model_validate(
        {
            **tiny_config(tmp_path, tracking_uri),
            "per_method": {"loop": {"loss_params": {"eps": 2e-5, "ratio_level": "turn"}}},
            "time_budget_s": 30,
        }
    )
    c = MlflowClient(tracking_uri)
    run_id, _ = mlflow_runs.find_or_create_run(c, "test", "params", {})
    with pytest.raises(ValueError, match=f"run {run_id} has no config.yaml artifact"):
        config_of_run(c, run_id)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=True))
    c.log_artifact(run_id, str(tmp_path / "config.yaml"))
    assert config_of_run(c, run_id) == cfg
    c.set_terminated(run_id)  # runs end (the suite checks none is left RUNNING)


def test_artifact_keys_are_prefect_safe():
    assert artifact_key("Ablation_household.easy") == "ablation-household-easy"


@pytest.mark.slow
def test_cells_are_nested_under_the_sweep_when_they_start(prefect_harness, tmp_path, tracking_uri):
    """Each cell's run is created under the sweep's parent when the cell starts (not when the sweep is
    queued: its start time and duration in the UI are the cell's), and the train flow continues it
    (params and tags logged)."""
    base = tiny_config(tmp_path, tracking_uri, iterations=1)
    for key in ("run_name", "seed"):
        base.pop(key)
    sweep(str(_write(tmp_path, {"grid": {"seed": [0, 1]}}, base)), in_process=True)
    c = MlflowClient(tracking_uri)
    exp = c.get_experiment_by_name("test")
    (parent,) = c.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = 's' and tags.`horizonrl.kind` = 'sweep'"
    )
    children = sorted(
        c.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"),
        key=lambda r: r.data.tags["cell.seed"],
    )
    assert [r.info.run_name for r in children] == ["s--seed=0", "s--seed=1"]
    for seed, run in enumerate(children):
        assert (
            run.info.status == "FINISHED" and run.data.params["method"] == "loop" and run.data.tags["seed"] == str(seed)
        )
        assert [m.step for m in c.get_metric_history(run.info.run_id, "eval/success_rate")] == [0, 1]
    assert children[1].info.start_time >= children[0].info.end_time, (
        "the second cell's run was created before the first ended"
    )
    # the comparison on the parent's page, without an artifact; success against environment steps per cell
    assert {"compare/base/final_mean", "compare/base/auc_mean", "compare/base/seeds"} <= set(parent.data.metrics)
    assert parent.data.metrics["compare/base/seeds"] == 2 and parent.data.tags["git_commit"]
    for run in children:
        env_steps = sorted(m.step for m in c.get_metric_history(run.info.run_id, "eval/success_by_env_steps"))
        assert len(env_steps) == 2 and env_steps[0] == 0 and env_steps[1] > 0
    # a cell still running (or killed) is left out of the report, and the page names it
    c.update_run(children[1].info.run_id, status="RUNNING")
    sweep_report("s", "test", tracking_uri, out=str(tmp_path / "page" / "results.md"))
    page = (tmp_path / "page" / "results.md").read_text()
    assert "- cells: 1 finished; **1 not finished, left out**: `s--seed=1`" in page
    assert c.get_run(parent.info.run_id).data.metrics["compare/base/seeds"] == 1
    # given the sweep file, a cell that has not started is named too
    grown = _write(tmp_path, {"grid": {"seed": [0, 1, 2]}, "tuning": "Nothing was tuned."}, base)
    sweep_report("s", "test", tracking_uri, sweep_path=str(grown), out=str(tmp_path / "page" / "results.md"))
    page = (tmp_path / "page" / "results.md").read_text()
    assert "- cells: 1 finished; **2 not finished, left out**: `s--seed=1`, `s--seed=2`" in page
    assert "## What was tuned\n\nNothing was tuned.\n" in page  # from the sweep file
    c.update_run(children[1].info.run_id, status="FINISHED")  # the cell that stood for a killed one


@pytest.mark.slow
def test_each_scheduled_firing_is_a_new_instance_compared_with_the_previous(prefect_harness, tmp_path, tracking_uri):
    """The scheduled deployment's logic fired twice: two instances (named by time and commit), the second's
    report compared against the first (page section, parent tag, Prefect artifact); a manual rerun of an
    instance resumes it. The cells stop on an environment-step budget, counted from the stored episodes."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from horizonrl import store

    base = tiny_config(tmp_path, tracking_uri, iterations=3)
    for key in ("run_name", "seed"):
        base.pop(key)
    base["env_step_budget"] = 1  # crossed by the first iteration's steps
    path = _write(tmp_path, {"name": "weekly", "grid": {"seed": [0, 1]}}, base)
    sweep(str(path), in_process=True, new_instance=True)
    sweep(str(path), in_process=True, new_instance=True)

    c = MlflowClient(tracking_uri)
    exp = c.get_experiment_by_name("test")
    parents = c.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{BASE_TAG}` = 'weekly'", order_by=["attributes.start_time ASC"]
    )
    assert len(parents) == 2 and all(p.info.status == "FINISHED" for p in parents)
    first, second = (p.data.tags[INSTANCE_TAG] for p in parents)
    assert first != second and [p.info.run_name for p in parents] == [f"weekly--{first}", f"weekly--{second}"]
    assert PREVIOUS_TAG not in parents[0].data.tags and parents[1].data.tags[PREVIOUS_TAG] == f"weekly--{first}"
    page = Path(c.download_artifacts(parents[1].info.run_id, "report/report.md", str(tmp_path / "dl"))).read_text()
    assert (
        f"## Compared with the previous instance (weekly--{first})" in page
        and "![held-out success against iteration](success_vs_iterations.png)" in page
    )
    assert (
        "## By task family" in page and "| variant | pick_and_place |" in page
    )  # the easy tier's one family, from MLflow
    with get_client(sync_client=True) as client:
        drift = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["weekly-drift"])))
    assert drift and f"weekly--{second} against weekly--{first}" in drift[0].data

    for parent in parents:
        cells = c.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
        assert len(cells) == 2
        for run in cells:
            assert run.data.metrics["summary/iterations"] == 1, "the environment-step budget did not stop the run"
            steps = store.env_steps(base["data_dir"], "test", run.info.run_name, range(1, 2))
            assert steps > 1 and run.data.metrics["time/env_steps"] == steps

    sweep(str(path), in_process=True, instance=second)  # a manual rerun of the second instance
    again = c.search_runs([exp.experiment_id], filter_string=f"tags.`{BASE_TAG}` = 'weekly'")
    assert len(again) == 2, "a rerun of an instance made a new one"
    assert (
        len(c.search_runs([exp.experiment_id], filter_string="tags.`horizonrl.run_name` LIKE 'weekly--%--seed=%'")) == 4
    )


@pytest.mark.slow
def test_the_page_shows_each_seeds_paired_change_and_the_prompted_baselines(
    prefect_harness, chat_model_dir, tmp_path, tracking_uri
):
    """A sweep of two seeds (one iteration, 8 held-out tasks x 2 samples at both ends) whose file names experiment
    ``baselines``, holding two real ``evaluate --model`` runs of an untrained model (the listed prompt, window and
    full context): the page gives each seed's paired change as its run logged it, and one row per finished
    baseline with the figures its run logged; a baseline run that did not finish is left out."""
    from flows.evaluate import evaluate_policy
    from horizonrl.tracking.sweep_runs import PAIRED

    folder = chat_model_dir("llama3")
    model_cfg = {**tiny_config(tmp_path, tracking_uri, "baseline"), "experiment": "baselines"}
    model_cfg["rollout"].update(prompt="listed")
    model_cfg["eval"].update(greedy=False)
    (tmp_path / "baseline.yaml").write_text(yaml.safe_dump(model_cfg))
    evaluated = [
        evaluate_policy(
            model=str(folder),
            config_path=str(tmp_path / "baseline.yaml"),
            n_tasks=4,
            tracking_uri=tracking_uri,
            overrides=[f"rollout.context={context}"],
        )
        for context in ("window", "full")
    ]
    base = tiny_config(tmp_path, tracking_uri, iterations=1)
    for key in ("run_name", "seed"):
        base.pop(key)
    base["env"]["max_turns"] = 20  # the tiny model wins a few episodes, so not every figure is 0
    base["eval"].update(n_tasks_ends=8, samples=2, greedy=False)
    path = _write(tmp_path, {"grid": {"seed": [4, 5]}, "baselines": "baselines"}, base)
    out = tmp_path / "page" / "results.md"
    sweep(str(path), in_process=True, out=str(out))
    page = out.read_text()

    c = MlflowClient(tracking_uri)
    for seed in (4, 5):
        run_id = mlflow_runs.find_run(c, "test", f"s--seed={seed}").info.run_id
        change, low, high, tasks = (c.get_metric_history(run_id, key) for key in PAIRED)
        assert [m.step for m in change] == [1] and tasks[0].value == 8
        first, last = sorted(c.get_metric_history(run_id, "eval/success_rate"), key=lambda m: m.step)
        assert (
            f"seed {seed} {first.value:.3f} -> {last.value:.3f}: {100 * change[0].value:+.1f} points "
            f"[{100 * low[0].value:+.1f}, {100 * high[0].value:+.1f}] on 8 paired tasks" in page
        )
    assert "## Paired by held-out task" in page and "- base: seed 4 " in page
    rows = [line for line in page.splitlines() if line.startswith(f"| `{folder}` |")]
    expected = []
    for result, context in zip(evaluated, ("window", "full")):
        assert c.get_run(result["run_id"]).data.params["rollout.context"] == context
        expected.append(
            f"| `{folder}` | household | easy | test | admissible | listed | {context} | 4 (4) | "
            f"{result['success_rate']:.3f} [{result['success_ci_low']:.3f}, {result['success_ci_high']:.3f}] | "
            f"`{result['run_id']}` |"
        )
    assert rows == sorted(expected), page  # full before window: the table's order, not the runs'
    assert "## Prompted baselines" in page and "in MLflow experiment `baselines`" in page

    c.set_terminated(evaluated[0]["run_id"], "FAILED")  # the window-context run, as if it had failed
    sweep_report("s", "test", tracking_uri, sweep_path=str(path), out=str(out))
    assert [line for line in out.read_text().splitlines() if line.startswith(f"| `{folder}` |")] == [
        e for e in expected if "| window |" not in e
    ]

    full = c.get_run(evaluated[1]["run_id"])  # the full-context cell evaluated again: its newest run is its row
    again = c.create_run(full.info.experiment_id, tags=full.data.tags).info.run_id
    for key, value in full.data.params.items():
        c.log_param(again, key, value)
    for key, value in {**full.data.metrics, "eval/success_rate": 0.75}.items():
        c.log_metric(again, key, value)
    c.set_terminated(again, "FINISHED")
    sweep_report("s", "test", tracking_uri, sweep_path=str(path), out=str(out))
    [row] = [line for line in out.read_text().splitlines() if line.startswith(f"| `{folder}` |")]
    assert f"`{again}`" in row and "| 0.750 [" in row


def test_a_running_flow_run_whose_process_is_gone_is_abandoned(tmp_path):
    """A cell's flow run left RUNNING when its machine or stack stopped is resubmitted by the next sweep
    (``run_cell``); one whose process still holds the run's lock, or that started moments ago (it takes
    the lock within seconds), is waited for."""
    from datetime import datetime, timedelta
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Running

    from horizonrl.config import load_config, run_dir
    from horizonrl.config.sweep import Cell
    from horizonrl.run import runlock
    from tasks.sweep import _abandoned

    cell = Cell({"seed": 0}, load_config(None, [f"data_dir={tmp_path}", "run_name=c"]))
    run_dir(cell.config).mkdir(parents=True)
    now = datetime.now(UTC)

    def flow_run(started_ago_s: float) -> FlowRun:
        return FlowRun(
            id=uuid4(), name="c", flow_id=uuid4(), state=Running(), start_time=now - timedelta(seconds=started_ago_s)
        )

    assert _abandoned(flow_run(3600), cell), "an hour-old RUNNING flow run with nobody holding the lock"
    assert not _abandoned(flow_run(5), cell), "started moments ago: its process may not have taken the lock yet"
    with runlock.hold(run_dir(cell.config)):
        assert not _abandoned(flow_run(3600), cell), "its process holds the run's lock: alive"


def test_a_resumed_sweep_with_a_changed_setting_is_refused_unless_allowed(prefect_harness, tmp_path, tracking_uri):
    """A finished cell's sweep extended (``iterations`` 2) with a new ``update.lr``: ``horizonrl sweep`` refuses
    before any work, naming the cell and the field; with ``--allow-change update.lr`` the cell resumes and its
    run records the change (``config-history.json``), as ``horizonrl train --allow-change`` does."""
    import contextlib
    import io
    import json

    from flows.cli import main
    from horizonrl.run import config_history

    base = tiny_config(tmp_path, tracking_uri, iterations=1)
    base.pop("run_name")
    base["eval"] = {"every": 1, "n_tasks": 2, "greedy": False}
    path = _write(tmp_path, {"grid": {"seed": [0]}}, base)
    assert main(["sweep", str(path), "--here"]) == 0
    path = _write(tmp_path, {"set": ["iterations=2", "update.lr=0.5"], "grid": {"seed": [0]}}, base)
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        assert main(["sweep", str(path), "--here"]) == 2
    assert "cell 's--seed=0'" in stderr.getvalue() and "update.lr 0.001 -> 0.5" in stderr.getvalue()
    run_folder = tmp_path / "data" / "test" / "s--seed=0"
    assert not (run_folder / config_history.HISTORY_FILE).exists(), "refused before any work"
    assert main(["sweep", str(path), "--here", "--allow-change", "update.lr"]) == 0
    history = json.loads((run_folder / config_history.HISTORY_FILE).read_text())
    assert {"iteration": 2, "field": "update.lr", "old": "0.001", "new": "0.5"} in history["changes"]
    assert (run_folder / "checkpoints" / "iter=00002").is_dir()
