"""End-to-end: the real Prefect ``train`` flow on ``household`` with real MLflow (SQLite) and Parquet.

Tiny sizes (2 tasks x 2 rollouts, 4 turns) keep each run to seconds; what is checked is the plumbing:
every stage's metrics at every iteration, inputs, the episode table, the model, and a finished run resumed
for more iterations.
"""

from __future__ import annotations

import pytest
from flowkit import run_of, steps, tiny_config

from horizonrl import store
from horizonrl.files import file_digest
from horizonrl.tracking import mlflow_runs
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
    from horizonrl.run.learner import Learner

    loads = []  # the policy is read from disk once, at the start: checkpoints it writes stay in memory
    load = Learner.load
    monkeypatch.setattr(Learner, "load", lambda self, cfg, path: loads.append(str(path)) or load(self, cfg, path))
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
    from flows.evaluate import config_of_run
    from horizonrl.config import TrainConfig

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

    # the same run asked for one more iteration resumes after its last one: nothing rewritten, one more step
    # (a kill in the middle of an iteration: tests/test_reliability.py kills the CLI at every stage)
    first = store.iteration_dir(tmp_path / "data", "test", "e2e", 1) / "episodes.parquet"
    digest = file_digest(first)
    train(config=_config(tmp_path, tracking_uri, iterations=3))
    assert file_digest(first) == digest, "a completed iteration was rewritten"
    for key in ("collect/success_rate", "update/steps"):
        assert steps(c, run.info.run_id, key) == [1, 2, 3], key
    assert _episodes_by_step(c, run.info.run_id) == {0: 4, 1: 3, 2: 4, 3: 4}, "the new last evaluation on n_tasks_ends"
    commit = mlflow_runs.git_commit()
    assert c.get_run(run.info.run_id).data.tags[mlflow_runs.COMMITS_TAG] == commit, (
        "a resume at the same commit adds none"
    )
