"""End-to-end: the real Prefect ``train`` flow on ``household`` with real MLflow (SQLite) and Parquet.

Tiny sizes (2 tasks x 2 rollouts, 4 turns) keep each run to seconds; what is checked is the plumbing:
every stage's metrics at every iteration, inputs, the episode table, the model, a finished run resumed
for more iterations, and the change paired by task that the last evaluation logs.
"""

from __future__ import annotations

import json
import time

import pytest
from flowkit import run_of, steps, tiny_config

from horizonrl import store
from horizonrl.files import file_digest
from horizonrl.tracking import mlflow_runs
from horizonrl.training import iteration as iteration_module
from mlflow import MlflowClient

pytestmark = pytest.mark.slow


def _config(tmp_path, tracking_uri: str, iterations: int = 2) -> dict:
    cfg = tiny_config(tmp_path, tracking_uri, iterations=iterations)
    cfg["eval"]["n_tasks_ends"] = 4  # the evaluations before training and after the last iteration: 4 tasks, not 3
    return cfg


def _episodes_by_step(c: MlflowClient, run_id: str) -> dict[int, float]:
    return {m.step: m.value for m in c.get_metric_history(run_id, "eval/episodes")}


def test_train_flow_logs_every_stage(prefect_harness, tmp_path, tracking_uri, monkeypatch):
    from flows.train import train
    from horizonrl.run.learner import Weights

    loads = []  # the policy is read from disk once, at the start: checkpoints it writes stay in memory
    load = Weights.load
    monkeypatch.setattr(Weights, "load", lambda self, path: loads.append(str(path)) or load(self, path))
    read_state = iteration_module.read_state  # each update takes 1 s more, so its time cannot hide in noise
    monkeypatch.setattr(iteration_module, "read_state", lambda *a, **k: time.sleep(1.0) or read_state(*a, **k))
    summary = train(config=_config(tmp_path, tracking_uri))
    assert len(loads) == 1 and "/models/tiny-qwen2-household-" in loads[0], loads
    assert set(summary) >= {"initial_success_rate", "final_success_rate", "improvement"}
    c = MlflowClient(tracking_uri)
    run = run_of(c, "e2e")
    assert run.data.params["method"] == "loop" and run.data.params["rollout.group_size"] == "2"
    assert run.data.tags["method"] == "loop" and run.data.tags["seed"] == "3" and len(run.data.tags["git_commit"]) >= 7
    for key in ("collect/success_rate", "advantage/kept_fraction", "update/steps", "time/iteration_s"):
        assert steps(c, run.info.run_id, key) == [1, 2], key
    assert steps(c, run.info.run_id, "eval/success_rate") == [0, 1, 2]
    assert steps(c, run.info.run_id, "time/eval_s") == [0, 1, 2]
    assert all(m.value > 0 for m in c.get_metric_history(run.info.run_id, "time/eval_s"))
    assert _episodes_by_step(c, run.info.run_id) == {0: 4, 1: 3, 2: 4}, (
        "eval.n_tasks_ends at the two ends, eval.n_tasks between"
    )
    assert [m.value for m in c.get_metric_history(run.info.run_id, "update/lr")] == [1e-3, 1e-3], (
        "update.lr, not annealed (lr_final unset)"
    )
    inputs = {d.dataset.name for d in run.inputs.dataset_inputs}
    assert {"iter=1/turns", "iter=1/episodes", "iter=2/advantages-loop"} <= inputs
    artifacts = {a.path for a in c.list_artifacts(run.info.run_id, "episodes")}
    assert "episodes/eval_iter_00002.json" in artifacts
    from horizonrl.config import TrainConfig
    from tasks.evaluation_run import config_of_run

    assert config_of_run(c, run.info.run_id) == TrainConfig.model_validate(
        _config(tmp_path, tracking_uri)
    )  # what `evaluate` reloads
    assert run.info.status == "FINISHED"
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    models = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
    assert any(m.source_run_id == run.info.run_id for m in models)
    run_dir = tmp_path / "data" / "test" / "e2e"
    for it in (1, 2):
        d = store.iteration_dir(tmp_path / "data", "test", "e2e", it)
        episodes = store.read_table(d / "episodes.parquet", "episodes")
        assert episodes.num_rows == 4 and set(episodes["iteration"].to_pylist()) == {it}
        store.read_table(d / "turns.parquet", "turns")
        store.read_table(d / "advantages-loop.parquet", "advantages")
    assert (run_dir / "checkpoints" / "iter=00002" / "model.safetensors").is_file()
    train_s = {m.step: m.value for m in c.get_metric_history(run.info.run_id, "time/train_s")}
    saved_s = json.loads((run_dir / "checkpoints" / "iter=00002" / "state.json").read_text())["elapsed_s"]
    assert 0 <= train_s[2] - saved_s < 1.0, (
        "the checkpoint's training time includes its update (a resume lost each resumed iteration's update)"
    )

    # the same run asked for one more iteration resumes after its last one: nothing rewritten, one more step
    # (a kill in the middle of an iteration: tests/test_reliability.py kills the CLI at every stage)
    first = store.iteration_dir(tmp_path / "data", "test", "e2e", 1) / "episodes.parquet"
    digest = file_digest(first)
    train(config=_config(tmp_path, tracking_uri, iterations=3))
    assert file_digest(first) == digest, "a completed iteration was rewritten"
    for key in ("collect/success_rate", "update/steps"):
        assert steps(c, run.info.run_id, key) == [1, 2, 3], key
    assert _episodes_by_step(c, run.info.run_id) == {0: 4, 1: 3, 2: 4, 3: 4}, "the new last evaluation on n_tasks_ends"
    iteration_3_s = c.get_metric_history(run.info.run_id, "time/iteration_s")[-1].value
    train_3_s = c.get_metric_history(run.info.run_id, "time/train_s")[-1].value
    assert train_3_s == pytest.approx(saved_s + iteration_3_s, abs=0.05), "the resumed count goes on from the save"
    commit = mlflow_runs.git_commit()
    assert c.get_run(run.info.run_id).data.tags[mlflow_runs.COMMITS_TAG] == commit, (
        "a resume at the same commit adds none"
    )


def test_the_last_evaluation_logs_the_change_paired_by_task(prefect_harness, tmp_path, tracking_uri):
    """Iteration 0 and the last one (2) evaluate the same 8 held-out tasks, 2 samples each; the last logs the
    change paired by task, its 95% interval and the task count, as recomputed here with pandas from the two
    stored ``eval-episodes.parquet``; iteration 1 (not an end) and iteration 0 log none."""
    import pandas as pd

    from flows.train import train
    from horizonrl.tracking import stats

    cfg = tiny_config(tmp_path, tracking_uri, run_name="paired")
    cfg["seed"], cfg["env"]["max_turns"] = 4, 20  # the tiny model wins a few episodes, so not every figure is 0
    cfg["eval"].update(n_tasks_ends=8, samples=2, greedy=False)
    summary = train(config=cfg)
    c = MlflowClient(tracking_uri)
    run_id = run_of(c, "paired").info.run_id
    names = ("paired_change", "paired_change_low", "paired_change_high", "paired_tasks")
    for name in names:
        assert steps(c, run_id, f"eval/{name}") == [2], name
    logged = {name: c.get_metric_history(run_id, f"eval/{name}")[0].value for name in names}
    assert {name: summary[name] for name in names} == logged, "the flow's summary (the command prints it)"

    files = [store.iteration_dir(tmp_path / "data", "test", "paired", it) / "eval-episodes.parquet" for it in (0, 2)]
    tables = [pd.read_parquet(f, columns=["task_id", "task_seed", "won"]) for f in files]
    assert [len(t) for t in tables] == [16, 16]  # 8 tasks x 2 samples at each end
    before, after = (t.groupby(["task_id", "task_seed"])["won"].mean() for t in tables)
    diff = (after - before).dropna()  # aligned on (task_id, task_seed): the same 8 tasks both times
    assert len(diff) == 8 and logged["paired_tasks"] == 8
    assert logged["paired_change"] == pytest.approx(diff.mean())
    in_key_order = [diff[k] for k in sorted(diff.index, key=lambda k: f"{k[0]}@{k[1]}")]  # stats resamples in it
    expected = stats.interval(in_key_order)
    assert (logged["paired_change_low"], logged["paired_change_high"]) == pytest.approx((expected.low, expected.high))
    assert logged["paired_change_low"] <= logged["paired_change"] <= logged["paired_change_high"]
