"""End-to-end on the real local stack: ``prefect server`` + a process worker + ``mlflow server`` on
loopback (free ports, PREFECT_HOME and the MLflow store in a temporary folder), ``prefect deploy --all``
from the project's ``prefect.yaml``, and the sweep deployment run with ``prefect deployment run`` on a
tiny grid (loop, grpo x 2 seeds, 1 iteration) fanned out to the train deployment. Nothing is mocked.

One stack serves the module's tests; the fixture takes it down and checks that no process is left.
The browser tests need Debian's chromium (``make setup-test`` installs it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from flowkit import REPO, Browser, deployed_sweep, free_port, leftovers, prefect_cli
import horizonrl_stack as stack
from horizonrl import traces

pytestmark = pytest.mark.slow
SWEEP = "tiny-sweep"
MODEL = "tiny-sweep-best"
HISTORIES = ("eval/success_rate", "collect/episodes", "collect/mean_turns", "collect/tokens_per_episode", "time/train_s")


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The stack, up; the sweep deployment run to completion. Yields (stack, root, timings)."""
    root = tmp_path_factory.mktemp("stack")
    prefect_home = root / "prefect-home"
    s = stack.Stack(home=root / ".stack", store=root / "mlflow", prefect_port=free_port(), mlflow_port=free_port(),
                    env={"PREFECT_HOME": str(prefect_home), "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_UI_ENABLED": "false",
                         "TOKENIZERS_PARALLELISM": "false"})
    sweep_file = deployed_sweep(root, s.mlflow_uri, SWEEP, iterations=1, concurrency=2, register_best=MODEL)
    timings = {}
    t0 = time.perf_counter()
    stack.up(s)
    timings["stack_up_s"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        prefect_cli(s.environ(), "deploy", "--all", timeout=180)
        timings["deploy_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        prefect_cli(s.environ(), "deployment", "run", "sweep/sweep", "--param", f"sweep_path={sweep_file}", "--watch", "--watch-timeout", "300", timeout=330)
        timings["sweep_run_s"] = time.perf_counter() - t0
        yield s, root, timings
    finally:
        t0 = time.perf_counter()
        stack.down(s)
        timings["stack_down_s"] = time.perf_counter() - t0
        print("\nstack timings:", {k: round(v, 1) for k, v in timings.items()})
    assert not leftovers(str(prefect_home)), f"processes left after stack down: {leftovers(str(prefect_home))}"
    assert all(v is None for v in stack.status(s).values())


def _parent_and_children(c: MlflowClient):
    exp = c.get_experiment_by_name("test")
    parents = c.search_runs([exp.experiment_id], filter_string=f"tags.`horizonrl.run_name` = '{SWEEP}'")
    assert len(parents) == 1, "one parent run per sweep"
    parent = parents[0]
    children = c.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return exp, parent, children


def test_sweep_deployment_logs_parent_children_metrics_and_report(swept):
    s, root, _ = swept
    c = MlflowClient(s.mlflow_uri)
    _, parent, children = _parent_and_children(c)
    assert parent.info.status == "FINISHED" and parent.data.tags["horizonrl.kind"] == "sweep"
    cells = sorted((r.data.tags["cell.method"], r.data.tags["cell.seed"]) for r in children)
    assert cells == [("grpo", "0"), ("grpo", "1"), ("loop", "0"), ("loop", "1")]
    for run in children:
        assert run.info.status == "FINISHED"
        assert json.loads(run.data.tags["horizonrl.cell"]) == {"method": run.data.tags["cell.method"], "seed": int(run.data.tags["cell.seed"])}
        assert run.data.params["method"] == run.data.tags["cell.method"] and run.data.tags["seed"] == run.data.tags["cell.seed"]
        assert sorted(m.step for m in c.get_metric_history(run.info.run_id, "eval/success_rate")) == [0, 1]
        for key in ("collect/success_rate", "advantage/kept_fraction", "update/steps"):
            assert [m.step for m in c.get_metric_history(run.info.run_id, key)] == [1], key
    report_files = {a.path for a in c.list_artifacts(parent.info.run_id, "report")}
    assert report_files == {"report/comparison.json", "report/report.md", "report/success_vs_iterations.png", "report/success_vs_env_steps.png",
                            "report/success_vs_wall_s.png"}
    png = Path(c.download_artifacts(parent.info.run_id, "report/success_vs_env_steps.png", str(root / "dl")))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    versions = c.search_model_versions(f"name = '{MODEL}'")
    assert len(versions) == 1 and versions[0].run_id == parent.data.tags["horizonrl.best_run_id"]
    assert versions[0].run_id in {r.info.run_id for r in children}
    import httpx

    keys = [f"{SWEEP}-report", f"{SWEEP}-summary"]
    found = httpx.post(f"{s.prefect_api}/artifacts/filter", json={"artifacts": {"key": {"any_": keys}}}).json()
    assert sorted((a["key"], a["type"]) for a in found) == [(keys[0], "table"), (keys[1], "markdown")]
    # the cells ran as flow runs of the train deployment, never more than `concurrency: 2` at once
    flow_runs = httpx.post(f"{s.prefect_api}/flow_runs/filter", json={"flow_runs": {"name": {"like_": f"{SWEEP}--"}}}).json()
    assert sorted(r["name"] for r in flow_runs) == sorted(r.info.run_name for r in children)
    assert all(r["state_type"] == "COMPLETED" and r["deployment_id"] for r in flow_runs)
    spans = [(r["start_time"], r["end_time"]) for r in flow_runs]
    assert max(sum(a <= t < b for a, b in spans) for t, _ in spans) <= 2


def test_report_numbers_match_mlflow_metrics(swept):
    """Every figure of the parent's comparison table, recomputed here from the children's metrics."""
    s, root, _ = swept
    c = MlflowClient(s.mlflow_uri)
    _, parent, children = _parent_and_children(c)
    table = json.loads(Path(c.download_artifacts(parent.info.run_id, "report/comparison.json", str(root / "dl2"))).read_text())
    rows = {r["variant"]: r for r in (dict(zip(table["columns"], d)) for d in table["data"])}
    assert sorted(rows) == ["grpo", "loop"]
    for method, row in rows.items():
        per_seed = []
        for run in (r for r in children if r.data.tags["cell.method"] == method):
            h = {k: {m.step: m.value for m in c.get_metric_history(run.info.run_id, k)} for k in HISTORIES}
            success = [h["eval/success_rate"][i] for i in sorted(h["eval/success_rate"])]
            steps = sorted(h["eval/success_rate"])
            auc = sum((success[i] + success[i + 1]) / 2 * (steps[i + 1] - steps[i]) for i in range(len(steps) - 1)) / (steps[-1] - steps[0])
            tokens = sum(h["collect/episodes"][i] * h["collect/tokens_per_episode"][i] for i in h["collect/episodes"])
            per_seed.append({"final": success[-1], "best": max(success), "auc": auc, "tokens": tokens, "train_s": h["time/train_s"][max(h["time/train_s"])]})
        assert row["seeds"] == len(per_seed) == 2
        for name in ("final", "best", "auc"):
            x = np.array([p[name] for p in per_seed])
            assert row[f"{name}_mean"] == pytest.approx(x.mean(), abs=1e-12)
            assert (row[f"{name}_low"], row[f"{name}_high"]) == (pytest.approx(x.min(), abs=1e-12), pytest.approx(x.max(), abs=1e-12))  # 2 seeds: their range
        assert row["tokens"] == pytest.approx(np.mean([p["tokens"] for p in per_seed])) and row["tokens"] > 0
        assert row["train_s"] == pytest.approx(np.mean([p["train_s"] for p in per_seed])) and row["train_s"] > 0


def test_evaluate_deployment_logs_a_linked_run(swept):
    """The registered best policy, evaluated on the train split through the evaluate deployment."""
    s, _, _ = swept
    prefect_cli(s.environ(), "deployment", "run", "evaluate/evaluate", "--param", f"source=models:/{MODEL}/1", "--param", "split=train",
             "--param", "n_tasks=2", "--watch", "--watch-timeout", "120", timeout=150)
    c = MlflowClient(s.mlflow_uri)
    exp, parent, _ = _parent_and_children(c)
    runs = c.search_runs([exp.experiment_id], filter_string="tags.`horizonrl.kind` = 'evaluation'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["horizonrl.source_run_id"] == parent.data.tags["horizonrl.best_run_id"]
    assert runs[0].data.params["eval.split"] == "train" and runs[0].data.params["eval.n_tasks"] == "2"
    assert [m.step for m in c.get_metric_history(runs[0].info.run_id, "eval/success_rate")] == [1]


def test_mlflow_ui_shows_the_sweep_runs(swept):
    """Headless chromium renders the MLflow UI (a JavaScript app): the experiment page lists the sweep's
    parent run, and the parent's page lists its four cell runs. Screenshots go to test-artifacts/."""
    s, root, _ = swept
    browser = shutil.which("chromium")
    assert browser, "Debian's chromium is not installed: run `make setup-test` (or apt-get install -y chromium)"
    c = MlflowClient(s.mlflow_uri)
    exp, parent, children = _parent_and_children(c)
    out = REPO / "test-artifacts"
    out.mkdir(exist_ok=True)
    pages = {"mlflow_experiment_page": (f"#/experiments/{exp.experiment_id}/runs", [SWEEP]),
             "mlflow_sweep_run_page": (f"#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}", [r.info.run_name for r in children])}
    for name, (route, expected) in pages.items():
        shot = out / f"{name}.png"
        shot.unlink(missing_ok=True)
        dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--user-data-dir={root / 'chromium'}",
                              "--window-size=1600,1000", "--virtual-time-budget=15000", f"--screenshot={shot}", "--dump-dom", f"{s.mlflow_uri}/{route}"],
                             capture_output=True, text=True, timeout=120).stdout
        missing = [run_name for run_name in expected if f">{run_name}<" not in dom]
        assert not missing, f"{name}: runs not shown: {missing}"
        assert shot.is_file() and shot.stat().st_size > 10_000, f"{name}: no screenshot"


def test_mlflow_ui_shows_an_episode_trace_turn_by_turn(swept):
    """In a cell run's Traces tab, a training episode's trace opens to its turn spans; a turn shows the
    observation, the action and the advantage. Screenshot: test-artifacts/mlflow_episode_trace.png."""
    s, root, _ = swept
    c = MlflowClient(s.mlflow_uri)
    exp, _, children = _parent_and_children(c)
    run = next(r for r in children if r.data.tags["cell.method"] == "loop")
    found = c.search_traces(locations=[exp.experiment_id], run_id=run.info.run_id, filter_string="tags.split = 'train'",
                             order_by=["timestamp_ms DESC"], max_results=1)  # the newest: the top of the run's list
    assert found, "the cell run has no training episode trace"
    trace = found[0]
    turn = min((sp for sp in trace.data.spans if sp.parent_id), key=lambda sp: sp.attributes["turn"])
    shot = REPO / "test-artifacts" / "mlflow_episode_trace.png"
    shot.parent.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)
    b = Browser(root / "chromium-trace")
    try:
        tab = f"{s.mlflow_uri}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}/traces"  # the run page's Traces tab
        b.open(tab)
        b.wait_for("Session", trace.info.tags["task"])  # its list of episode traces
        b.open(f"{tab}?selectedTraceId={trace.info.trace_id}&selectedEvaluationId={trace.info.trace_id}")  # one opened
        b.wait_for(trace.data.spans[0].name, turn.name)
        b.click(turn.name)
        b.wait_for("observation", turn.inputs["observation"].strip()[:40], "action", turn.outputs["action"], "advantage")
        b.screenshot(shot)
    finally:
        b.close()
    assert shot.stat().st_size > 10_000


def test_mlflow_ui_compares_the_cells_on_the_sweep_run(swept):
    """The sweep's parent run lists every variant's held-out success (final, AUC, interval) in its
    Metrics table, and the experiment's chart view grouped by ``cell.method`` draws loop against grpo,
    held-out success against environment steps (the README's three clicks): no artifact to open.
    Screenshots: test-artifacts/mlflow_sweep_comparison.png, test-artifacts/mlflow_success_vs_env_steps.png."""
    s, root, _ = swept
    c = MlflowClient(s.mlflow_uri)
    exp, parent, _ = _parent_and_children(c)
    metrics = parent.data.metrics
    assert parent.data.tags["git_commit"] not in ("", "unknown")
    for method in ("loop", "grpo"):
        assert {f"compare/{method}/{k}" for k in ("final_mean", "final_low", "final_high", "best_mean", "auc_mean", "seeds")} <= set(metrics)
    shot, chart = REPO / "test-artifacts" / "mlflow_sweep_comparison.png", REPO / "test-artifacts" / "mlflow_success_vs_env_steps.png"
    shot.unlink(missing_ok=True)
    chart.unlink(missing_ok=True)
    b = Browser(root / "chromium-compare")
    try:
        b.open(f"{s.mlflow_uri}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}")
        b.wait_for("compare/loop/final_mean")
        b.type_into("Search metrics", "final_mean")
        b.wait_for("compare/loop/final_mean", "compare/grpo/final_mean")
        b.screenshot(shot)
        b.open(f"{s.mlflow_uri}/#/experiments/{exp.experiment_id}/runs?compareRunsMode=CHART")  # click 1: the chart view
        b.wait_for("Group by")
        b.click("Group by")                                                                     # click 2
        b.wait_for("cell.method")
        b.click("cell.method")                                                                  # click 3
        b.wait_for("Group: loop", "Group: grpo")
        b.type_into("Search metric charts", "success_by_env_steps")  # charts render only when scrolled to
        b.wait_for("loop (eval/success_by_env_steps)", "grpo (eval/success_by_env_steps)")
        b.screenshot(chart)
    finally:
        b.close()
    assert shot.stat().st_size > 10_000 and chart.stat().st_size > 10_000
